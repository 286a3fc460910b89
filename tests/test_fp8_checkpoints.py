"""Block-FP8 checkpoints as DeepSeek-V3 and the Qwen3 -FP8 releases publish them, read directly
(issue 51, FP8 in): tiny ones of both (scripts/make_tiny_model.py --fp8: three shards, partial
edge blocks) convert at PP2 and match transformers at TP2xEP2 and TP2xPP2; the reader's
dequantized weights equal vLLM's own block dequantizer's; other formats and broken checkpoints
are refused before any output.

The reference is transformers on the FP8 checkpoint dequantized by vLLM's block_dequant, not
transformers loading the FP8 files itself: transformers 5.19's Fp8Dequantize takes the block
size from the scale grid (rows // scale rows), so it dequantizes partial edge blocks with the
wrong blocks (measured on qwen3_moe_fp8's 192-row experts: 0.05 off) and refuses DeepSeek-V3's
576-row kv_a_proj_with_mqa ("not divisible by scale grid") outright. Where it is right (no
partial block after a whole one) transformers reading the FP8 files itself gives the reference's
log-probs (test_transformers_own_fp8_read_is_the_reference_where_it_is_right).
"""

import json
import math
import os
import shutil

import pytest
import torch

from tests.fp8_reference import vllm_dequantized
from tests.launch import by_layout, last_json, run

FP8_MODELS = ["deepseek_v3_fp8", "qwen3_moe_fp8"]
# One 4-rank launch checks both layouts: TP2xEP2 as the issue names it, and PP2 (with TP2).
LAYOUTS = {"tp2_ep2": (4, {"tp": 2, "ep": 2}, FP8_MODELS),
           "tp2_pp2": (4, {"tp": 2, "pp": 2}, FP8_MODELS)}


@pytest.fixture(scope="module")
def fp8_dirs(tmp_path_factory):
    """{name: (FP8 HF dir, its vLLM-dequantized copy)}."""
    from megarl.demo.tiny_checkpoint import make_named

    root = tmp_path_factory.mktemp("fp8")
    return {name: (make_named(name, str(root / name)),
                   vllm_dequantized(str(root / name), str(root / f"{name}.reference")))
            for name in FP8_MODELS}


# Large enough that a shard outweighs the interpreter's own noise (about 10 MB), with partial edge
# blocks (2880 = 22.5 x 128): 16 layers of 11.8M weights in three shards of up to 72 MB (at 8 layers
# the peak came within 14 MiB of the bound, 40-46 MiB at 16).
MEMORY_MODEL = dict(dtype="bfloat16", fp8=True, hidden_size=1024, num_attention_heads=16,
                    num_key_value_heads=8, intermediate_size=2880, num_hidden_layers=16)


@pytest.fixture(scope="module")
def fp8_models(fp8_dirs, tmp_path_factory):
    """{name: (FP8 HF dir, its vLLM-dequantized copy, Megatron dir converted at PP2)}, and under
    "memory" (HF dir, Megatron dir, each rank's peak RSS while converting): one 2-rank launch of
    the converter's function, each rank a pipeline stage. The memory model converts last, so the
    launch's one-time costs (imports, the checkpoint writer's) are behind it."""
    from megarl.demo.tiny_checkpoint import make_named

    root = tmp_path_factory.mktemp("fp8_megatron")
    models = {name: (hf, reference, str(root / name)) for name, (hf, reference) in fp8_dirs.items()}
    jobs = [["hf_to_megatron", hf, megatron] for hf, _, megatron in models.values()]
    big = make_named("qwen3", str(root / "memory.hf"), **MEMORY_MODEL)
    jobs.append(["hf_to_megatron_peak_rss", big, str(root / "memory")])
    proc = run("tests/workers/convert_models.py", "--jobs", json.dumps(jobs), nproc=2, timeout=900)
    models["memory"] = (big, str(root / "memory"), last_json(proc)["peak_rss"])
    return models


@pytest.fixture(scope="module")
def results(fp8_models, tmp_path_factory):
    return by_layout("tests/workers/layout_parity.py", LAYOUTS,
                     lambda m: [m, fp8_models[m][1], fp8_models[m][2]],
                     tmp_path_factory.mktemp("fp8_parity"), {4})


@pytest.mark.parametrize("layout,model", [(layout, model) for layout in LAYOUTS for model in FP8_MODELS])
def test_fp8_checkpoint_converts_and_matches_transformers(results, layout, model):
    """tests/test_layout_parity.py's thresholds: log-probs 1e-4 abs, loss 1e-5 and gradients
    5e-5 relative."""
    summary = results(layout)[model]["summary"]
    assert summary["max_abs_logprob_diff"] <= 1e-4, summary
    assert summary["loss_rel_diff"] <= 1e-5, summary
    assert summary["max_grad_rel_diff"] <= 5e-5, summary


def test_peak_memory_is_one_shard_plus_the_rank_s_megatron_shard(fp8_models):
    """Each rank's peak RSS while converting a 3-shard FP8 checkpoint at PP2, above what it held
    before, is at most the largest shard's tensors dequantized into the training dtype (bf16:
    twice the FP8 bytes) plus the rank's Megatron shard (its .distcp files). Holding every shard
    it reads mapped, or a dequantized copy of a shard, goes over."""
    from safetensors import safe_open

    hf, megatron, peaks = fp8_models["memory"]
    shard_bytes = []
    for name in (f for f in os.listdir(hf) if f.endswith(".safetensors")):
        with safe_open(os.path.join(hf, name), framework="pt") as handle:
            shard_bytes.append(sum(2 * math.prod(handle.get_slice(t).get_shape())  # bf16
                                   for t in handle.keys() if not t.endswith("_scale_inv")))
    largest = max(shard_bytes)
    for rank, peak in enumerate(peaks):
        mine = sum(os.path.getsize(os.path.join(megatron, f)) for f in os.listdir(megatron)
                   if f.startswith(f"__{rank}_") and f.endswith(".distcp"))
        print(f"rank {rank}: peak RSS +{peak / 2**20:.1f} MiB, bound {largest / 2**20:.1f} + "
              f"{mine / 2**20:.1f} MiB")
        assert peak <= largest + mine, (f"rank {rank}: peak RSS +{peak / 2**20:.1f} MiB > largest shard "
                                        f"{largest / 2**20:.1f} MiB (bf16) + Megatron shard "
                                        f"{mine / 2**20:.1f} MiB")


@pytest.mark.parametrize("model", FP8_MODELS)
def test_reader_dequantizes_as_vllm_does(model, fp8_dirs):
    """Every tensor the reader gives equals vLLM's block_dequant of the same codes and scales (fp32,
    bit for bit), the scales are not among its names, and the published layout is there: several
    shards, float8_e4m3fn codes with fp32 scales, partial edge blocks, the bf16-kept tensors."""
    from safetensors.torch import load_file

    from megarl.demo.tiny_checkpoint import FP8_SHARDS
    from megarl.models.hf.config import load_arch
    from megarl.models.hf.weights_io import open_hf

    hf, reference_dir = fp8_dirs[model]
    reference = load_file(os.path.join(reference_dir, "model.safetensors"))
    arch = load_arch(hf)
    assert arch.fp8_block == (128, 128)
    reader = open_hf(hf, arch)
    try:
        assert sorted(reader.names()) == sorted(reference)
        for name in reference:
            assert torch.equal(reader(name), reference[name]), name
        stored = {}
        for filename in set(reader._reader.weight_map.values()):
            stored.update(load_file(os.path.join(hf, filename)))
    finally:
        reader.close()
    assert len({f for f in os.listdir(hf) if f.endswith(".safetensors")}) == FP8_SHARDS
    scales = {n: t for n, t in stored.items() if n.endswith("_scale_inv")}
    assert scales and all(t.dtype == torch.float32 for t in scales.values())
    assert all(stored[n[:-len("_scale_inv")]].dtype == torch.float8_e4m3fn for n in scales)
    partial = [n for n in scales if any(s % 128 and s > 128 for s in stored[n[:-len("_scale_inv")]].shape)]
    assert partial, "no partial edge block"
    kept = ("model.embed_tokens.weight", "lm_head.weight", "model.layers.1.mlp.gate.weight")
    assert all(stored[n].dtype == torch.float32 and n + "_scale_inv" not in stored for n in kept)


def test_transformers_own_fp8_read_is_the_reference_where_it_is_right(tmp_path):
    """The tiny Qwen3-MoE's own sizes (experts of 64 rows: one partial block per dimension) are
    what transformers dequantizes right: its forward on the FP8 files themselves equals its
    forward on vLLM's dequantization of them, so the reference above is transformers' FP8 read
    wherever that read is correct."""
    import transformers

    from megarl.checks.parity import fixed_tokens
    from megarl.demo.tiny_checkpoint import make_named

    hf = make_named("qwen3_moe", str(tmp_path / "fp8"), fp8=True)
    tokens = fixed_tokens(250, 2, 16)
    logits = []
    for folder in (hf, vllm_dequantized(hf, str(tmp_path / "reference"))):
        model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        with torch.no_grad():
            logits.append(model(tokens).logits)
    assert torch.equal(*logits)


def _copy(hf: str, to: str) -> str:
    shutil.copytree(hf, to)
    return to


def _edit_config(hf: str, **fields) -> None:
    path = os.path.join(hf, "config.json")
    with open(path) as f:
        config = json.load(f)
    with open(path, "w") as f:
        json.dump({**config, **fields}, f)


@pytest.mark.parametrize("published", ["DEEPSEEK_V3", "KIMI_K2", "QWEN3_30B_A3B", "QWEN3_32B"])
def test_published_fp8_configs_are_read(published):
    """The published configs with the quantization_config their FP8 releases carry (DeepSeek-V3,
    Kimi-K2 and the Qwen3 -FP8 ones: block FP8 e4m3, 128 x 128, dynamic activations) describe the
    same model with its block size: the weights are dequantized on load, the model is bf16."""
    import dataclasses

    from megarl.demo.tiny_checkpoint import FP8_CONFIG
    from megarl.models.hf.config import arch_from_hf_config
    from tests import published_configs

    config = getattr(published_configs, published)
    arch = arch_from_hf_config({**config, "quantization_config": dict(FP8_CONFIG)})
    assert arch.fp8_block == (128, 128) and arch.dtype == "bfloat16"
    assert dataclasses.replace(arch, fp8_block=()) == arch_from_hf_config(config)


REFUSED_FORMATS = {
    # name: (quantization_config, words the message must hold)
    "per-tensor FP8": ({"quant_method": "fp8", "activation_scheme": "dynamic"},
                       ["no weight_block_size", "per-tensor"]),
    "compressed-tensors": ({"quant_method": "compressed-tensors", "format": "float-quantized"},
                           ["'compressed-tensors'", "dequantize to bf16 first"]),
    # Kimi-K2-Thinking's INT4 W4A16: compressed-tensors' pack-quantized
    "INT4": ({"quant_method": "compressed-tensors", "format": "pack-quantized",
              "config_groups": {"group_0": {"weights": {"num_bits": 4, "type": "int"}}}},
             ["INT4", "dequantize to bf16 first"]),
    "AWQ": ({"quant_method": "awq", "bits": 4}, ["'awq'", "block-FP8"]),
}


@pytest.mark.parametrize("name", sorted(REFUSED_FORMATS))
def test_other_formats_are_refused_by_name(name):
    from megarl.models.hf.config import arch_from_hf_config
    from megarl.models.hf.fp8_blocks import block_size

    quantization, words = REFUSED_FORMATS[name]
    config = {"architectures": ["Qwen3MoeForCausalLM"], "quantization_config": quantization}
    with pytest.raises(ValueError) as refused:
        block_size(quantization)
    message = str(refused.value)
    assert all(word in message for word in words), message
    with pytest.raises(ValueError, match="quantization_config"):
        arch_from_hf_config({**_qwen3_moe_config(), **config})


def _qwen3_moe_config() -> dict:
    from megarl.demo.tiny_checkpoint import BASE, FAMILIES

    fields = {**BASE, **FAMILIES["qwen3_moe"]}
    return {**fields, "hidden_act": "silu"}


def test_broken_fp8_checkpoints_are_refused_before_any_output(fp8_dirs, tmp_path):
    """From the headers, before a tensor is read: a scale whose shape disagrees with its weight
    and the config's block (the script run: no output appears), an FP8 weight without its scale,
    a scale without its weight."""
    from safetensors.torch import load_file, save_file

    from megarl.models.hf.config import load_arch
    from megarl.models.hf.weights_io import open_hf

    hf = fp8_dirs["qwen3_moe_fp8"][0]
    blocks64 = _copy(hf, str(tmp_path / "blocks64"))
    _edit_config(blocks64, quantization_config={**json.load(open(os.path.join(hf, "config.json")))
                                                ["quantization_config"], "weight_block_size": [64, 64]})
    proc = run("scripts/convert.py", "hf-to-megatron", "--hf-dir", blocks64, "--out",
               str(tmp_path / "out"), check=False)
    assert proc.returncode != 0
    assert "needs (" in proc.stderr and "weights and config.json disagree" in proc.stderr, proc.stderr[-2000:]
    assert not (tmp_path / "out").exists()

    def without(name: str) -> str:
        """The checkpoint with tensor `name` gone from its shard and its index."""
        folder = _copy(hf, str(tmp_path / name))
        index = os.path.join(folder, "model.safetensors.index.json")
        with open(index) as f:
            contents = json.load(f)
        path = os.path.join(folder, contents["weight_map"].pop(name))
        tensors = load_file(path)
        del tensors[name]
        save_file(tensors, path, metadata={"format": "pt"})
        with open(index, "w") as f:
            json.dump(contents, f)
        return folder

    weight = "model.layers.2.self_attn.q_proj.weight"
    without_scale, without_weight = without(weight + "_scale_inv"), without(weight)
    for folder, words in ((without_scale, f"{weight} is stored as F8_E4M3 without"),
                          (without_weight, "FP8 scales without their weight")):
        with pytest.raises(ValueError) as refused:
            open_hf(folder, load_arch(folder)).close()
        assert words in str(refused.value)
