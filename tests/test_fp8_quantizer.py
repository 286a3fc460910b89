"""The block-FP8 quantizer of the FP8 export (megarl/models/hf/fp8_blocks.py) against the
reference, DeepGEMM's per_block_cast_to_fp8 as vLLM ships it: bit for bit, over fuzzed shapes with
partial edge blocks, bf16 and fp32 inputs, zero blocks and blocks of very different magnitudes;
the round trip's error within e4m3's half-ulp of each block; which tensors an export quantizes,
its quantization_config, and the families refused."""

import random

import pytest
import torch
from vllm.utils.deep_gemm import per_block_cast_to_fp8

from megarl.models.hf import fp8_blocks
from megarl.models.weights.tables import check_export_dtype

SEEDS = range(16)


def _weight(seed: int):
    """A random [m, n] weight, each 128x128 block scaled by its own 10^U(-6, 3), one block zero
(where there are several)."""
    rng = random.Random(seed)
    m, n = rng.randint(1, 400), rng.randint(1, 400)
    dtype = (torch.bfloat16, torch.float32)[seed % 2]
    generator = torch.Generator().manual_seed(seed)
    rows, cols = -(-m // 128), -(-n // 128)
    magnitudes = 10.0 ** (torch.rand(rows, cols, generator=generator) * 9 - 6)
    if rows * cols > 1:
        magnitudes[rng.randrange(rows), rng.randrange(cols)] = 0.0
    per_element = magnitudes.repeat_interleave(128, 0).repeat_interleave(128, 1)[:m, :n]
    return (torch.randn(m, n, generator=generator) * per_element).to(dtype)


@pytest.mark.parametrize("seed", SEEDS)
def test_quantizer_is_the_reference_bit_for_bit(seed):
    weight = _weight(seed)
    codes, scales = fp8_blocks.quantize(weight)
    expected_codes, expected_scales = per_block_cast_to_fp8(weight, [128, 128])
    assert codes.dtype == torch.float8_e4m3fn and scales.dtype == torch.float32
    assert torch.equal(codes.view(torch.uint8), expected_codes.view(torch.uint8)), weight.shape
    assert torch.equal(scales, expected_scales), weight.shape


@pytest.mark.parametrize("seed", SEEDS)
def test_round_trip_error_is_within_half_an_e4m3_ulp_per_block(seed):
    """|dequantize(quantize(x)) - x| <= scale * half an e4m3 ulp at x / scale (3 mantissa bits:
    2^(e - 4) for a normal value in [2^e, 2^(e+1)), 2^-10 below e4m3's smallest normal, 2^-6),
    plus fp32 rounding; a zero block comes back zero."""
    weight = _weight(seed)
    codes, scales = fp8_blocks.quantize(weight)
    back = fp8_blocks.dequantize(codes, scales)
    x = weight.float()
    scale = scales.repeat_interleave(128, 0).repeat_interleave(128, 1)[:x.shape[0], :x.shape[1]]
    exponent = torch.floor(torch.log2((x / scale).abs())).clamp(min=-6)
    bound = scale * torch.exp2(exponent - 4) * (1 + 2 ** -10) + x.abs() * 2 ** -22
    error = (back - x).abs()
    assert (error <= bound).all(), (error / bound).max()
    assert torch.equal(back[x == 0], x[x == 0])
    # the bound is tight: some value of a non-trivial block is off by more than a quarter of it
    assert (error > bound / 4).any()


def test_export_quantizes_linear_weights_and_keeps_the_rest_bf16():
    source = {"model.embed_tokens.weight": torch.randn(250, 256),
              "model.layers.0.self_attn.q_proj.weight": torch.randn(200, 256),
              "model.layers.0.input_layernorm.weight": torch.randn(256),
              "model.layers.0.mlp.gate.weight": torch.randn(8, 256),
              "model.layers.0.mlp.gate.e_score_correction_bias": torch.randn(8),
              "model.layers.0.mlp.experts.3.down_proj.weight": torch.randn(256, 64),
              "model.layers.1.block_sparse_moe.gate.weight": torch.randn(8, 256),
              "lm_head.weight": torch.randn(250, 256)}
    config = fp8_blocks.export_quantization_config(None, source)
    assert config == {**fp8_blocks.FP8_CONFIG, "modules_to_not_convert": [
        "lm_head", "model.layers.0.mlp.gate", "model.layers.1.block_sparse_moe.gate"]}
    out = fp8_blocks.quantize_tensors(source, config)
    quantized = ["model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.experts.3.down_proj.weight"]
    assert sorted(out) == sorted([*source, *(fp8_blocks.scale_name(n) for n in quantized)])
    for name in quantized:
        codes, scales = fp8_blocks.quantize(source[name])
        assert torch.equal(out[name].view(torch.uint8), codes.view(torch.uint8))
        assert torch.equal(out[fp8_blocks.scale_name(name)], scales)
    assert out["model.layers.0.mlp.gate.e_score_correction_bias"].dtype == torch.float32
    kept = set(source) - set(quantized) - {"model.layers.0.mlp.gate.e_score_correction_bias"}
    assert all(torch.equal(out[n], source[n].to(torch.bfloat16)) for n in kept)


def test_a_block_fp8_source_config_is_kept_and_decides():
    """An export of a model that came from a block-FP8 checkpoint keeps that checkpoint's
    quantization_config, modules_to_not_convert included, and quantizes by it."""
    source = {**fp8_blocks.FP8_CONFIG, "modules_to_not_convert": ["model.layers.0.self_attn.o_proj"]}
    tensors = {"model.layers.0.self_attn.o_proj.weight": torch.randn(4, 4),
               "model.layers.0.self_attn.q_proj.weight": torch.randn(4, 4)}
    assert fp8_blocks.export_quantization_config(source, tensors) == source
    out = fp8_blocks.quantize_tensors(tensors, source)
    assert out["model.layers.0.self_attn.o_proj.weight"].dtype == torch.bfloat16
    assert out["model.layers.0.self_attn.q_proj.weight"].dtype == torch.float8_e4m3fn
    config = fp8_blocks.export_config({"torch_dtype": "float32", "quantization_config": source}, tensors)
    assert config == {"torch_dtype": "bfloat16", "quantization_config": source}


@pytest.mark.parametrize("family,advice", [("gpt_oss", "--experts mxfp4"), ("qwen3_next", "auto"),
                                           ("qwen3_5_moe", "auto")])
def test_families_without_a_block_fp8_export_are_refused(family, advice):
    with pytest.raises(ValueError) as refused:
        check_export_dtype(family, "fp8", "--dtype")
    assert all(part in str(refused.value) for part in ("--dtype fp8", family, advice)), refused.value
    check_export_dtype(family, "auto", "--dtype")
    with pytest.raises(ValueError, match=r"'fp16'.*\['auto', 'fp8'\]"):
        check_export_dtype("qwen3", "fp16", "checkpoint.export_dtype")


def test_a_run_refuses_an_fp8_export_of_gpt_oss_before_it_starts(tmp_path):
    """checkpoint.export_dtype: an unknown value when the config loads, a family without a block-FP8
    export when the run resolves against its checkpoint (preflight), not after training."""
    from megarl.demo.tiny_checkpoint import make_named
    from megarl.planning.config import RunConfig
    from megarl.planning.resolved import resolve
    from megarl.planning.typed_config import load

    base = [f"model.hf_dir={make_named('gpt_oss', str(tmp_path / 'gpt_oss'))}", "data.path=d.jsonl"]
    with pytest.raises(ValueError, match=r"checkpoint.export_dtype='fp16': expected auto .* or fp8"):
        load(RunConfig, None, [*base, "checkpoint.export_dtype=fp16"])
    with pytest.raises(ValueError, match=r"checkpoint.export_dtype fp8: gpt_oss has no block-FP8 export; "
                                         r"export in the model's dtype \(auto\), or its experts as MXFP4"):
        resolve(load(RunConfig, None, [*base, "checkpoint.export_dtype=fp8"]))
    # no export, nothing to refuse
    assert resolve(load(RunConfig, None, [*base, "checkpoint.export_dtype=fp8",
                                          "checkpoint.export_hf=false"]))
