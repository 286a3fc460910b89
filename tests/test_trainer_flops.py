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
    step_flops,
    throughput_metrics,
)
from tests.published_configs import (
    DEEPSEEK_V3,
    MIXTRAL_8X7B,
    PUBLISHED_ACTIVE_PARAMS,
    QWEN3_30B_A3B,
)

FAMILIES = ["llama", "llama_tied", "qwen2", "qwen3", "qwen3_moe", "mixtral", "glm4_moe", "deepseek_v3",
            "gpt_oss"]


def _hf(hf_dir: str):
    """(ModelArch, HF config, top-k) of a tiny checkpoint."""
    with open(os.path.join(hf_dir, "config.json")) as f:
        cfg = json.load(f)
    return arch_from_hf_config(cfg), transformers.AutoConfig.from_pretrained(hf_dir), cfg.get(
        "num_experts_per_tok", 0)


def weights_per_token(model: torch.nn.Module, topk: int) -> int:
    """Matmul weights one token meets, read off the module tree: every 2-D weight outside the
    embedding (tied LM heads are counted as the head's matmul), and of the 3-D expert banks
    [experts, out, in] only top-k experts' worth; biases are no matmul (gpt-oss's expert biases
    are 2-D banks [experts, out])."""
    total = 0
    for module in model.modules():
        if isinstance(module, torch.nn.Embedding):
            continue  # a lookup
        for name, param in module.named_parameters(recurse=False):
            if name.endswith("bias"):
                continue
            if param.dim() == 2:
                total += param.numel()
            elif param.dim() == 3:
                total += topk * param[0].numel()
    return total


@pytest.mark.parametrize("name", FAMILIES)
def test_parameter_part_matches_hf_module_shapes(name, hf_models):
    arch, config, topk = _hf(hf_models[name])
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    active = weights_per_token(model, topk)
    assert matmul_params(arch) == active
    assert forward_flops(arch, tokens=37, seq_len_sum_sq=0) == 2 * active * 37
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
    tokens, sum_sq = sum(lengths), sum(n * n for n in lengths)
    assert counter.get_total_flops() == (forward_flops(arch, tokens, sum_sq)
                                         + attention_flops(arch, sum_sq))


@pytest.mark.parametrize("key,published", [("qwen3_30b_a3b", QWEN3_30B_A3B), ("mixtral_8x7b", MIXTRAL_8X7B),
                                           ("deepseek_v3", DEEPSEEK_V3)])
def test_active_parameters_match_the_model_cards(key, published):
    arch = arch_from_hf_config(published)
    with_embedding = matmul_params(arch) + arch.vocab_size * arch.hidden_size
    assert with_embedding == pytest.approx(PUBLISHED_ACTIVE_PARAMS[key], rel=0.02)


def test_phases_of_a_step_count_backward_and_epochs(hf_models):
    arch, _, _ = _hf(hf_models["qwen3_moe"])
    phases = rl_phases([3, 5, 7], [3, 5], reference=True, critic=True, actor_epochs=2, critic_epochs=1)
    assert list(phases) == ["generate", "old_logprobs", "ref_logprobs", "values", "actor_update",
                            "critic_update"]  # the loop's timer names
    flops = step_flops(arch, phases)
    assert flops["generate"] == forward_flops(arch, 15, 9 + 25 + 49)
    assert flops["old_logprobs"] == flops["ref_logprobs"] == forward_flops(arch, 8, 34)
    assert flops["values"] == forward_flops(arch, 8, 34, head="value")
    assert flops["actor_update"] == 2 * 3 * forward_flops(arch, 8, 34)
    assert flops["critic_update"] == 3 * flops["values"]
    assert list(rl_phases([4], [4], reference=False, critic=False, actor_epochs=1, critic_epochs=1)) == [
        "generate", "old_logprobs", "actor_update"]
    assert Phase.of([2, 3], passes=2) == Phase(tokens=10, seq_len_sum_sq=26)
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

