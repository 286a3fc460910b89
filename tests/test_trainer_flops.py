"""The FLOPs formula against independent counts: the weights of the real HF modules (top-k experts
only for MoE), and the matmul FLOPs torch's FlopCounterMode counts in an HF forward. Plus the
published active-parameter counts, phase bookkeeping, MFU and the memory probe."""

import json
import os

import pytest
import torch
import transformers
from torch.utils.flop_counter import FlopCounterMode

from megarl.models.hf.config import arch_from_hf_config
from megarl.planning.flops import (
    Phase,
    attention_flops,
    forward_flops,
    matmul_params,
    mfu,
    rl_phases,
    scored_pairs_x2,
    step_flops,
    throughput_metrics,
)
from tests.published_configs import (
    DEEPSEEK_V3,
    GPT_OSS_120B,
    MIXTRAL_8X7B,
    PUBLISHED_ACTIVE_PARAMS,
    QWEN3_30B_A3B,
    QWEN35_397B_A17B,
)

FAMILIES = ["llama", "llama_tied", "qwen2", "qwen3", "qwen3_moe", "mixtral", "glm4_moe", "deepseek_v3",
            "gpt_oss"]
# Gated DeltaNet hybrids: their weights against the modules; the delta rule by hand (below), since
# transformers' chunked kernel does more matmul work than the recurrence the formula counts.
HYBRIDS = ["qwen3_next"]


def _hf(hf_dir: str):
    """(ModelArch, HF config, top-k) of a tiny checkpoint."""
    with open(os.path.join(hf_dir, "config.json")) as f:
        cfg = json.load(f)
    return arch_from_hf_config(cfg), transformers.AutoConfig.from_pretrained(hf_dir), cfg.get(
        "num_experts_per_tok", 0)


def weights_per_token(model: torch.nn.Module, topk: int) -> int:
    """Matmul weights one token meets, read off the module tree: every 2-D weight outside the
    embedding (tied LM heads are counted as the head's matmul), a depthwise convolution's every
    weight (one multiply-add per weight per token), and of the 3-D expert banks [experts, out,
    in] only top-k experts' worth; biases are no matmul (gpt-oss's expert biases are 2-D banks
    [experts, out])."""
    total = 0
    for module in model.modules():
        if isinstance(module, torch.nn.Embedding):
            continue  # a lookup
        for name, param in module.named_parameters(recurse=False):
            if name.endswith("bias"):
                continue
            if isinstance(module, torch.nn.Conv1d) or param.dim() == 2:
                total += param.numel()
            elif param.dim() == 3:
                total += topk * param[0].numel()
    return total


@pytest.mark.parametrize("name", FAMILIES + HYBRIDS)
def test_parameter_part_matches_hf_module_shapes(name, hf_models):
    arch, config, topk = _hf(hf_models[name])
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    active = weights_per_token(model, topk)
    assert matmul_params(arch) == active
    assert forward_flops(arch, [37]) == 2 * active * 37 + attention_flops(arch, [37])
    assert matmul_params(arch, head="value") == active - arch.hidden_size * (arch.vocab_size - 1)


@pytest.mark.parametrize("name", FAMILIES)
def test_formula_matches_counted_hf_forward(name, hf_models):
    """Eager attention computes the whole s x s score matrix and masks it afterwards; the formula
    counts the causal half (Megatron-LM's convention), hence the factor 2 on that term."""
    arch, config, _ = _hf(hf_models[name])
    moe = {"experts_implementation": "eager"} if arch.num_experts else {}  # grouped_mm goes uncounted
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager", **moe)
    lengths = [5, 11]
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        for n in lengths:
            model(torch.randint(0, arch.vocab_size, (1, n)))
    if arch.sliding_window:  # eager scores every pair and masks; within the window none is masked
        assert max(lengths) <= arch.sliding_window
    assert counter.get_total_flops() == forward_flops(arch, lengths) + attention_flops(arch, lengths)


def test_window_and_delta_rule_layers_by_hand(hf_models):
    """gpt-oss's window layers (16 tokens; layers 0 and 2 of 4) score fewer pairs once a sequence
    outgrows the window, each packed sequence on its own; Qwen3-Next's three Gated DeltaNet layers
    cost their state's reads and write per token, its one full-attention layer the usual pairs."""
    for s, w in [(1, 16), (5, 16), (16, 16), (40, 16), (40, 1)]:
        mask = torch.ones(s, s).tril().triu(-(w - 1))  # query p sees keys max(0, p - w + 1) .. p
        assert mask.sum() == sum(min(p + 1, w) for p in range(s))
        # the continuous count, as s^2/2 is for the causal mask's s(s+1)/2
        assert scored_pairs_x2([s], w) == 2 * mask.sum() - min(s, w)
    assert scored_pairs_x2([40, 5], 16) == scored_pairs_x2([40], 16) + scored_pairs_x2([5], 16)

    arch, _, _ = _hf(hf_models["gpt_oss"])
    assert (arch.sliding_window, arch.window_layers) == (16, (True, False, True, False))
    per_pair = 4 * (64 + 64)  # heads x (q.k width + value width)
    full, windowed = 40 * 40 + 5 * 5, (40 * 40 - 24 * 24) + 5 * 5
    assert attention_flops(arch, [40, 5]) == 2 * per_pair * full + 2 * per_pair * windowed
    assert attention_flops(arch, [16, 5]) == 4 * per_pair * (16 * 16 + 5 * 5)  # none beyond the window

    arch, _, _ = _hf(hf_models["qwen3_next"])
    assert arch.layer_types == ("linear_attention",) * 3 + ("full_attention",)
    state = 64 * 64  # key dim x value dim of each of the 4 value heads
    assert attention_flops(arch, [40, 5]) == 3 * (6 * 4 * state * 45) + 4 * (64 + 64) * (40 * 40 + 5 * 5)


@pytest.mark.parametrize("key,published", [("qwen3_30b_a3b", QWEN3_30B_A3B), ("mixtral_8x7b", MIXTRAL_8X7B),
                                           ("deepseek_v3", DEEPSEEK_V3)])
def test_active_parameters_match_the_model_cards(key, published):
    arch = arch_from_hf_config(published)
    with_embedding = matmul_params(arch) + arch.vocab_size * arch.hidden_size
    assert with_embedding == pytest.approx(PUBLISHED_ACTIVE_PARAMS[key], rel=0.02)


def test_active_parameters_of_gpt_oss_and_a_hybrid():
    """gpt-oss-120b's model card counts 5.13B active parameters without the embedding (its
    unembedding counted); Qwen3.5-397B-A17B's name says 17B with it (Gated DeltaNet layers' own
    projections and convolution, the gated attention's wider q, the shared expert and its gate)."""
    gpt_oss, hybrid = arch_from_hf_config(GPT_OSS_120B), arch_from_hf_config(QWEN35_397B_A17B)
    assert matmul_params(gpt_oss) == pytest.approx(5.13e9, rel=0.005)
    assert matmul_params(hybrid) + hybrid.vocab_size * hybrid.hidden_size == pytest.approx(17e9, rel=0.03)


def test_phases_of_a_step_count_backward_and_epochs(hf_models):
    arch, _, _ = _hf(hf_models["qwen3_moe"])
    phases = rl_phases([3, 5, 7], [3, 5], reference=True, critic=True, actor_epochs=2, critic_epochs=1)
    assert list(phases) == ["generate", "old_logprobs", "ref_logprobs", "values", "actor_update",
                            "critic_update"]  # the loop's timer names
    flops = step_flops(arch, phases)
    assert flops["generate"] == forward_flops(arch, [3, 5, 7])
    assert flops["old_logprobs"] == flops["ref_logprobs"] == forward_flops(arch, [3, 5])
    assert flops["values"] == forward_flops(arch, [3, 5], head="value")
    assert flops["actor_update"] == 2 * 3 * forward_flops(arch, [3, 5])
    assert flops["critic_update"] == 3 * flops["values"]
    assert list(rl_phases([4], [4], reference=False, critic=False, actor_epochs=1, critic_epochs=1)) == [
        "generate", "old_logprobs", "actor_update"]
    assert Phase.of([2, 3], passes=2) == Phase(lengths=(2, 3), passes=2)
    with pytest.raises(ValueError, match="head='critic'; choose one of"):
        matmul_params(arch, head="critic")


def test_mfu_by_device_name():
    assert mfu(100e12, "cpu") is None
    assert mfu(100e12, "NVIDIA B300") is None
    assert mfu(494.5e12, "NVIDIA H100 80GB HBM3") == pytest.approx(0.5)
    assert mfu(378e12, "NVIDIA H100 PCIe") == pytest.approx(0.5)  # not the SXM peak
    assert mfu(494.5e12, "NVIDIA H200") == pytest.approx(0.5)
    assert mfu(156e12, "NVIDIA A100-SXM4-80GB") == pytest.approx(0.5)


def test_throughput_metrics():
    flops = {"generate": 2e15, "actor_update": 6e15}
    seconds = {"generate": 2.0, "advantages": 1.0, "actor_update": 2.0, "sync": 3.0}
    metrics = throughput_metrics(flops, seconds, world_size=8, device="NVIDIA H100 80GB HBM3")
    assert metrics["throughput/tflops_per_device"] == pytest.approx(125.0)  # 8e15 / 8 s / 8
    assert metrics["throughput/tflops_per_device/generate"] == pytest.approx(125.0)
    assert metrics["throughput/tflops_per_device/actor_update"] == pytest.approx(375.0)
    assert metrics["throughput/mfu"] == pytest.approx(125e12 / 989e12)
    assert "throughput/mfu" not in throughput_metrics(flops, seconds, 8, "cpu")

