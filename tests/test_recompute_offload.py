"""Activation recompute and optimizer offload (issue 34 item 2).

Recompute: loss and every gradient of one actor update equal recompute off (<= 1e-6, fp32) at TP2
(sequence parallel), PP2 (1F1B over 4 micro-batches), EP2 and MLA + shared experts at TP2 x EP2,
for full (uniform, block) and selective recompute; recompute really ran (more module forwards).
Offload: the weights after two updates with Megatron's optimizer offload (HybridDeviceOptimizer,
all and half of each shard on the host) equal the on-device optimizer's within bf16's rounding,
and Megatron built what was asked. One 2-rank launch runs every case (tests/workers/
recompute_offload.py); the config checks run in this process.
"""

import json

import pytest
import torch

from megarl.actor.config import ActorConfig
from megarl.actor.optimizer import OptimConfig, OptimizerOffloadConfig, offload_fields
from megarl.critic.config import CriticConfig
from megarl.demo.tiny_checkpoint import make_named
from megarl.models.hf.config import arch_from_hf_config, load_hf_config
from megarl.models.megatron.config import RecomputeConfig, recompute_fields, transformer_config
from megarl.parallel_state.dims import ParallelDims
from tests.launch import last_json, run

FULL_UNIFORM = {"granularity": "full", "method": "uniform", "num_layers": 1}
FULL_BLOCK = {"granularity": "full", "method": "block", "num_layers": 1}
RECOMPUTE = [
    # layout, ParallelDims fields, model, recompute settings (the tiny models have 4 layers)
    ("tp2", {"tp": 2}, "qwen3", [dict(FULL_UNIFORM, num_layers=2), FULL_BLOCK,
                                 {"granularity": "selective", "modules": ["core_attn", "mlp"]}]),
    ("pp2", {"pp": 2}, "qwen3", [FULL_UNIFORM, FULL_BLOCK,
                                 {"granularity": "selective", "modules": ["core_attn", "mlp"]}]),
    ("ep2", {"ep": 2}, "qwen3_moe", [FULL_UNIFORM,
                                     {"granularity": "selective", "modules": ["core_attn", "moe"]}]),
    ("tp2_ep2", {"tp": 2, "ep": 2, "etp": 1}, "deepseek_v3",
     [dict(FULL_BLOCK, num_layers=2),
      {"granularity": "selective", "modules": ["mla_up_proj", "moe", "shared_experts"]}]),
]
OFFLOAD = [("dp2", {}, "qwen3", [1.0, 0.5]), ("ep2", {"ep": 2}, "qwen3_moe", [0.5])]


@pytest.fixture(scope="module")
def results(hf_models):
    proc = run("tests/workers/recompute_offload.py",
               "--recompute", json.dumps([[name, fields, model, hf_models[model], settings]
                                          for name, fields, model, settings in RECOMPUTE]),
               "--offload", json.dumps([[name, fields, model, hf_models[model], fractions]
                                        for name, fields, model, fractions in OFFLOAD]),
               nproc=2, timeout=900)
    return last_json(proc)


@pytest.mark.parametrize("layout", [case[0] for case in RECOMPUTE])
def test_recompute_keeps_loss_and_gradients(results, layout):
    rows = [r for r in results["recompute"] if r["layout"] == layout]
    assert len(rows) == len(next(c[3] for c in RECOMPUTE if c[0] == layout))
    for row in rows:
        assert row["granularity"] == row["recompute"]["granularity"], row
        assert row["forwards"] > row["forwards_off"], row  # the modules really ran again
        assert row["loss_diff"] <= 1e-6 * max(1.0, abs(row["loss_off"])), row
        assert row["grad_diff"] <= 1e-6, row


def test_offloaded_optimizer_matches_the_on_device_one(results):
    rows = results["offload"]
    assert sorted((r["layout"], r["fraction"]) for r in rows) == sorted(
        (name, f) for name, _, _, fractions in OFFLOAD for f in fractions)
    for row in rows:
        built = row["optimizer"]
        assert built["classes"] == ["HybridDeviceOptimizer"], row
        assert row["reference_optimizer"]["classes"] == ["AdamW"], row
        # Megatron offloads whole parameters in order until the share is reached.
        assert row["fraction"] <= built["host_share"] < row["fraction"] + 0.1, row
        assert built["host_moment_devices"] == ["cpu"], row
        assert row["reference_moved_ulps"] > 50, row  # the updates moved the weights
        assert row["weight_ulps"] <= 1.0, row


@pytest.mark.parametrize("fields,message", [
    ({"granularity": "partial"}, "recompute.granularity='partial'"),
    ({"granularity": "full"}, "recompute.granularity=full needs recompute.method"),
    ({"granularity": "full", "method": "uniform", "num_layers": 0}, "num_layers >= 1"),
    ({"granularity": "selective", "num_layers": 1}, "leave them null"),
    ({"granularity": "full", "method": "block", "num_layers": 1, "modules": ("mlp",)},
     "applies to granularity=selective"),
    ({"granularity": "selective", "modules": ("attention",)}, "choose one or more of"),
])
def test_recompute_settings_are_refused_with_the_fix(fields, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("[", r"\[")):
        RecomputeConfig(**fields)


def test_recompute_fields_reach_megatron_or_name_the_problem(tmp_path):
    dense, moe = (arch_from_hf_config(load_hf_config(make_named(name, str(tmp_path / name))))
                  for name in ("qwen3", "qwen3_moe"))
    pp2 = ParallelDims(world_size=2, pp=2)  # 2 layers per stage
    built = transformer_config(dense, pp2, recompute=RecomputeConfig("full", "uniform", 2))
    assert (built.recompute_granularity, built.recompute_method, built.recompute_num_layers) == (
        "full", "uniform", 2)
    built = transformer_config(moe, pp2, recompute=RecomputeConfig("selective", modules=("moe", "core_attn")))
    assert (built.recompute_granularity, built.recompute_modules) == ("selective", ["moe", "core_attn"])
    assert transformer_config(dense, pp2).recompute_granularity is None
    cases = [(dense, RecomputeConfig("full", "uniform", 3), "must divide every pipeline stage's layers"),
             (dense, RecomputeConfig("full", "block", 3), "exceeds the most layers a pipeline stage holds"),
             (dense, RecomputeConfig("selective", modules=("moe",)), "qwen3 does not have"),
             (moe, RecomputeConfig("selective", modules=("layernorm",)), "need Transformer Engine")]
    for arch, recompute, message in cases:
        with pytest.raises(ValueError, match=message):
            recompute_fields(recompute, arch, pp2, use_te=False)


def test_offload_settings_and_the_optimizer_config_they_make():
    with pytest.raises(ValueError, match=r"fraction=1.5 must be in \[0, 1\]"):
        OptimizerOffloadConfig(fraction=1.5)
    with pytest.raises(ValueError, match="exp_avg_dtype='fp4'"):
        OptimizerOffloadConfig(exp_avg_dtype="fp4")
    with pytest.raises(ValueError, match="Megatron's offload ignores exp_avg_dtype='bf16'"):
        OptimizerOffloadConfig(fraction=0.5, exp_avg_dtype="bf16")
    plain = OptimConfig(use_distributed_optimizer=False)
    for section, config in (("actor", ActorConfig), ("critic", CriticConfig)):
        with pytest.raises(ValueError, match=f"set {section}.optim.use_distributed_optimizer=true"):
            config(optim=plain, optimizer_offload=OptimizerOffloadConfig(fraction=0.5))
    assert offload_fields(OptimizerOffloadConfig(), torch.bfloat16, on_gpu=False, use_te=False) == {}
    fields = offload_fields(OptimizerOffloadConfig(fraction=0.5), torch.bfloat16, on_gpu=True, use_te=True)
    assert fields == dict(optimizer_cpu_offload=True, optimizer_offload_fraction=0.5,
                          use_precision_aware_optimizer=True, pin_cpu_grads=True, pin_cpu_params=True)
    # Without Transformer Engine on a GPU too: the precision-aware optimizer's TE version check is
    # no_te_compat's, and the GPU half steps with torch's Adam, as on the CPU path.
    assert offload_fields(OptimizerOffloadConfig(fraction=0.5), torch.bfloat16, on_gpu=True,
                          use_te=False) == fields
    narrow = OptimizerOffloadConfig(exp_avg_dtype="bf16", exp_avg_sq_dtype="fp8")
    assert offload_fields(narrow, torch.bfloat16, on_gpu=True, use_te=True) == dict(
        use_precision_aware_optimizer=True, exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.uint8)
    whole = OptimizerOffloadConfig(fraction=1.0)
    refused = [(narrow, torch.bfloat16, False, False, "need Transformer Engine's FusedAdam"),
               (whole, torch.float32, False, False, "needs a bf16 or fp16 model")]
    for offload, dtype, on_gpu, use_te, message in refused:
        with pytest.raises(ValueError, match=message):
            offload_fields(offload, dtype, on_gpu=on_gpu, use_te=use_te)
