"""GPU smoke test of the demo in bf16, with Transformer Engine and CUDA vLLM: megarl takes the GPU
path; two PPO steps (GAE + critic, EP2 on Ray, vLLM rollouts) keep vLLM's log-probs on the actor's;
and scripts/verify_sync.py's sync matches them too, within its peak-memory bound measured by
torch.cuda.max_memory_allocated, and leaves every engine tensor as vLLM's own loader would; a
block-FP8 engine generates after a sync. Skipped without CUDA (conftest.py). The demo's EP2 layout takes
a GPU per rank (NCCL refuses two ranks on one device): a one-GPU node runs the same at EP1."""

import json
import math

import pytest
import torch

from megarl.planning.flops import mfu
from tests.launch import last_json, run

GPU = {"MEGARL_DEVICE": "cuda"}  # the GPU path or an error naming what is missing, never the CPU
# vLLM's log-probs against the actor's in bf16, where their kernels round differently: one bf16
# step on a logit of 2-8 is 0.016-0.06 (the CPU path in bf16 measured max 0.035-0.050, mean
# 0.0035 after a correct sync; 4.1 before it). Not yet measured on a GPU: loose on purpose, still
# far below a missed or misrouted sync.
BF16_LOGPROB_MAX, BF16_LOGPROB_MEAN = 0.25, 0.02
TE = "megatron.core.extensions.transformer_engine."


def _world() -> int:
    return min(2, torch.cuda.device_count())


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    """The demo's inputs (scripts/prepare_demo.py: model/, train.jsonl), the model turned to bf16:
    megarl and vLLM take the dtype from config.json. Made on the CPU path: the demo's model is
    fp32, and Transformer Engine has no fp32 attention for the packed (thd) sequences of its warm
    start. Its Megatron conversion (megatron/) stays fp32 and unused."""
    from safetensors.torch import load_file, save_file

    root = tmp_path_factory.mktemp("demo_inputs")
    run("scripts/prepare_demo.py", "--out", str(root), "--prompts", "200", env={"MEGARL_DEVICE": "cpu"})
    weights, config = root / "model" / "model.safetensors", root / "model" / "config.json"
    save_file({name: t.to(torch.bfloat16) for name, t in load_file(weights).items()}, weights,
              metadata={"format": "pt"})
    config.write_text(json.dumps({**json.loads(config.read_text()), "dtype": "bfloat16"}, indent=2))
    return root


def test_megarl_takes_the_gpu_path(inputs):
    probe = last_json(run("tests/gpu/gpu_path.py", "--hf-dir", str(inputs / "model"), env=GPU))
    assert probe["on_gpu"] and probe["backend"] == "nccl" and probe["param_device"] == "cuda", probe
    # Megatron's groups are NCCL only: no gloo copies, which megarl never uses (megatron_groups.py)
    assert probe["group_backends"] == ["nccl"], probe
    # Transformer Engine's layer spec: its attention, fused norm + QKV and grouped expert GEMMs.
    te = {TE + name for name in ("TEDotProductAttention", "TELayerNormColumnParallelLinear",
                                 "TEColumnParallelGroupedLinear")}
    assert te <= set(probe["modules"]), probe
    assert not [m for m in probe["modules"] if m.startswith("megarl.models.megatron.portable_layers.")], probe
    assert probe["vllm_platform"] == "cuda", probe


def test_two_ppo_steps_of_the_demo(inputs, tmp_path):
    world, run_dir = _world(), tmp_path / "run"
    run("scripts/train_ppo_moe.py", "--config", "configs/demo_cpu.yaml", f"model.hf_dir={inputs / 'model'}",
        "model.megatron_dir=null",  # the actor loads the bf16 HF model, as the critic does
        f"data.path={inputs / 'train.jsonl'}", f"run_dir={run_dir}", "steps=2",
        "data.prompts_per_step=8", f"layout.world_size={world}", f"layout.ep={world}",
        "checkpoint.every=0", "checkpoint.export_hf=false", timeout=900, env=GPU)
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [1, 2]
    for s in steps:
        assert all(math.isfinite(v) for v in s.values()), s
        assert "critic/value_loss" in s, s
        # Step 1 generates with the weights synced at start-up, step 2 with those step 1 trained.
        assert s["mismatch/logprob_diff_max"] <= BF16_LOGPROB_MAX, s
        assert s["mismatch/logprob_diff_mean"] <= BF16_LOGPROB_MEAN, s
        # The trainer itself saw the GPU: it reports MFU for the devices whose peak it knows.
        assert ("throughput/mfu" in s) == (mfu(1.0, torch.cuda.get_device_name()) is not None), s


def test_weight_sync_parity_and_peak_memory(inputs):
    world, bucket_mb = _world(), 1  # buckets of 1 MiB: the ~5 MB model streams in several
    result = last_json(run("scripts/verify_sync.py", "--hf-dir", str(inputs / "model"), "--ep", str(world),
                           "--rollout-tp", "1", "--bucket-mb", str(bucket_mb), "--perturb", "0.05",
                           "--loader-parity", "--max-logprob-diff", str(BF16_LOGPROB_MAX),
                           nproc=world, timeout=900, env=GPU))
    # The engine's synced tensors against vLLM's own loader's for the same weights (its HF export):
    # the same bf16 values put in the same places, processed by the same code, so equal in any
    # dtype, kernels playing no part (megarl/checks/loader_parity.py); tests/test_weight_sync.py
    # asserts the same on the CPU.
    assert result["weight_parity_max_abs_diff"] == [0.0] * world, result
    assert min(result["weight_parity_tensors"]) > 0, result
    assert result["max_abs_logprob_diff"] <= BF16_LOGPROB_MAX, result
    assert result["max_abs_logprob_diff_before_sync"] >= 4 * BF16_LOGPROB_MAX, result
    assert result["params_synced"] == result["params_expected"] > 0 and result["buckets"] > 1, result
    # Streaming: one bucket's engine modules opened and one round's buffers, never the model. The
    # measured peak (torch.cuda.max_memory_allocated on GPU) includes vLLM's processing of them.
    for planned, measured, largest in zip(result["peak_extra_bytes"], result["measured_peak_bytes"],
                                          result["largest_tensor_bytes"]):
        bound = 2 * bucket_mb * 2**20 + largest
        assert planned <= bound and 0 < measured <= bound, result


# FP8 engines (rollout.quantization fp8): vLLM's own FP8 kernels (W8A8, activations quantized per
# token group of 128 on top of the weights' blocks) against the bf16 actor. On the CPU (reference
# kernels, W8A16) the largest sampled-token difference measured 0.33-1.09 after a sync, 3.3-5.5
# before it (tests/test_fp8_engine.py; this test's command on the CPU: 1.09 and 3.34 for
# qwen3_moe_fp8_engine). Not yet measured on a GPU: loose on purpose.
FP8_LOGPROB_MAX = 1.5


@pytest.mark.parametrize("model", ["qwen3", "qwen3_moe_fp8_engine"])
def test_fp8_engine_generates_after_a_sync(model, tmp_path):
    """A block-FP8 engine (rollout/vllm/fp8_engine.py) on CUDA vLLM, its weights all from one sync
    of the bf16 actor: its tensors equal vLLM's own loader's from the same weights as a block-FP8
    checkpoint, and what it generates scores near the actor's log-probs (far nearer than before the
    sync). A dense and a MoE model, every slice whole 128-blocks."""
    from megarl.demo.tiny_checkpoint import make_named

    hf_dir = make_named(model, str(tmp_path / model), dtype="bfloat16")
    result = last_json(run("scripts/verify_sync.py", "--hf-dir", hf_dir, "--rollout-tp", "1",
                           "--perturb", "0.05", "--rollout-quantization", "fp8", "--loader-parity",
                           "--max-logprob-diff", str(FP8_LOGPROB_MAX), timeout=900, env=GPU))
    assert result["weight_parity_max_abs_diff"] == [0.0], result
    assert min(result["weight_parity_fp8_tensors"]) > 0, result
    assert result["params_synced"] == result["params_expected"] > 0, result
    assert result["samples"] > 0 and result["max_abs_logprob_diff"] <= FP8_LOGPROB_MAX, result
    assert result["max_abs_logprob_diff"] <= 0.5 * result["max_abs_logprob_diff_before_sync"], result
