"""The block-FP8 export (scripts/convert.py megatron-to-hf --dtype fp8, and the run's export with
checkpoint.export_dtype=fp8) of a tiny dense Qwen3, a Qwen3-MoE and a DeepSeek-V3 (MLA), through
two pipeline stages: the codes and scales are the reference quantizer's (vLLM's
per_block_cast_to_fp8) of the source weights, the other tensors the source's in bf16, config.json
carries the published quantization_config; vLLM's own loader reads every parameter back
bit for bit; transformers loads it, computing what it computes from our dequantized weights, and
log-probs near the source's; and an FP8 checkpoint converted and exported again keeps every code.

The MoE models' expert width is 128: vLLM 0.32 refuses to load block-FP8 experts narrower than a
block (its scale-refining loader breaks on down_proj), which no published checkpoint has; and
DeepSeek's q_lora_rank 128: vLLM loads a fused block-FP8 projection only when all but its last part
fill whole blocks (DeepSeek-V3's 1536 does)."""

import glob
import json
import os

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from vllm.utils.deep_gemm import per_block_cast_to_fp8

from megarl.models.hf import fp8_blocks
from tests.launch import last_json, run

MODELS = {"qwen3": {}, "qwen3_moe": {"moe_intermediate_size": 128},
          # its MTP layer stored: quantized as the other layers
          "deepseek_v3": {"moe_intermediate_size": 128, "q_lora_rank": 128, "mtp_weights": True}}
# How each is exported: the converter script's function, or the run's live export.
HOW = {"qwen3": "megatron_to_hf_fp8", "qwen3_moe": "export_hf_fp8", "deepseek_v3": "megatron_to_hf_fp8"}
# transformers 5.19 cannot dequantize DeepSeek-V3's kv_a_proj_with_mqa (576 rows: a partial block
# that does not divide its rows evenly; docs/conversion.md#fp8-out), published checkpoints' too.
IN_TRANSFORMERS = ["qwen3", "qwen3_moe"]
# (max, mean) |log p(token)| difference between the FP8 export and the fp32 source that
# transformers computes, over 2 x 23 positions: measured (0.363, 0.145) for Qwen3 and (0.635, 0.124)
# for Qwen3-MoE (a routing choice flips at one position); the tiny models' weights are drawn with a
# large std, which FP8's rounding (up to 1/16 of a value) carries through 4 layers.
LOGPROB_BAR = (0.8, 0.2)


def _tensors(folder: str) -> dict:
    out = {}
    for path in sorted(glob.glob(os.path.join(folder, "*.safetensors"))):
        with safe_open(path, "pt") as handle:
            out.update({name: handle.get_tensor(name) for name in handle.keys()})
    return out


def _config(folder: str) -> dict:
    with open(os.path.join(folder, "config.json")) as f:
        return json.load(f)


def _dequantized(fp8_dir: str, out_dir: str, dtype: torch.dtype) -> str:
    """The export as an unquantized HF checkpoint in `dtype`: each weight its codes times its
    block's scale."""
    tensors = _tensors(fp8_dir)
    plain = {name: (fp8_blocks.dequantize(t, tensors[fp8_blocks.scale_name(name)], dtype)
                    if fp8_blocks.scale_name(name) in tensors else t.to(dtype))
             for name, t in tensors.items() if not name.endswith("_scale_inv")}
    os.makedirs(out_dir)
    save_file(plain, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    config = {k: v for k, v in _config(fp8_dir).items() if k != "quantization_config"}
    name = str(dtype).removeprefix("torch.")
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump({**config, "torch_dtype": name, "dtype": name}, f)
    return out_dir


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    """{model: (source HF dir, FP8 export)}: converted and exported in one two-rank launch."""
    from megarl.demo.tiny_checkpoint import make_named

    root = tmp_path_factory.mktemp("fp8_export")
    out, jobs = {}, []
    for model, fields in MODELS.items():
        hf = make_named(model, str(root / f"{model}_hf"), **fields)
        megatron, fp8 = str(root / f"{model}_megatron"), str(root / f"{model}_fp8")
        export = [megatron, fp8] if HOW[model] == "megatron_to_hf_fp8" else [megatron, hf, fp8]
        jobs += [["hf_to_megatron", hf, megatron], [HOW[model], *export]]
        out[model] = (hf, fp8)
    run("tests/workers/convert_models.py", "--jobs", json.dumps(jobs), nproc=2, timeout=900)
    return out


@pytest.mark.parametrize("model", MODELS)
def test_export_is_the_reference_quantization_of_the_source(model, exports):
    hf, fp8 = exports[model]
    source, written = _tensors(hf), _tensors(fp8)
    config = _config(fp8)
    # the output layers (lm_head, an MTP layer's shared_head.head) and the routers
    kept = sorted(n[:-len(".weight")] for n in source if n.endswith(("head.weight", "mlp.gate.weight")))
    assert config["quantization_config"] == {**fp8_blocks.FP8_CONFIG, "modules_to_not_convert": kept}
    assert config["torch_dtype"] == "bfloat16"
    quantized = [n for n, t in source.items()
                 if fp8_blocks.is_quantized(n, tuple(t.shape), config["quantization_config"])]
    # every projection of attention and the MLP / experts (MLA's low-rank ones too), nothing else
    assert quantized == [n for n, t in source.items() if "proj" in n and t.dim() == 2]
    assert sorted(written) == sorted([*source, *(fp8_blocks.scale_name(n) for n in quantized)])
    for name, tensor in source.items():
        if name in quantized:
            codes, scales = per_block_cast_to_fp8(tensor, [128, 128])
            assert torch.equal(written[name].view(torch.uint8), codes.view(torch.uint8)), name
            assert torch.equal(written[fp8_blocks.scale_name(name)], scales), name
        else:  # DeepSeek's routing bias in fp32 as published, the rest in bf16
            dtype = torch.float32 if name.endswith("e_score_correction_bias") else torch.bfloat16
            assert written[name].dtype == dtype and torch.equal(written[name], tensor.to(dtype)), name
    with open(os.path.join(fp8, "model.safetensors.index.json")) as f:
        assert sorted(json.load(f)["weight_map"]) == sorted(written)


@pytest.mark.parametrize("model", MODELS)
def test_vllm_loads_every_parameter_bit_for_bit(model, exports):
    """vLLM's own loader (tests/workers/fp8_vllm_load.py: LLM() cannot build a block-FP8 model on
    this CPU) fills its fused, stacked FP8 parameters and scales with exactly the checkpoint's."""
    result = last_json(run("tests/workers/fp8_vllm_load.py", "--hf-dir", exports[model][1]))
    mtp = f"model.layers.{_config(exports[model][0])['num_hidden_layers']}."  # a drafter's, not read
    assert result["mismatched"] == [] and all(n.startswith(mtp) for n in result["unread"]), result
    assert all(name.endswith(("attn.q_scale", "attn.k_scale", "attn.v_scale", "attn.prob_scale"))
               for name in result["not_in_checkpoint"]), result  # the KV cache's, not weights
    assert result["compared"] >= 4 * 6 + 3, result


@pytest.mark.parametrize("model", IN_TRANSFORMERS)
def test_transformers_loads_it_and_log_probs_stay_near_the_source(model, exports, tmp_path):
    """transformers dequantizes the FP8 checkpoint itself (no FP8 matmul on a CPU): its logits
    equal those of our dequantized weights in fp32, and its log-probs are within LOGPROB_BAR of
    the source's."""
    import transformers

    hf, fp8 = exports[model]
    tokens = torch.randint(0, 250, (2, 24), generator=torch.Generator().manual_seed(0))

    def log_probs(folder: str):
        logits = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)(tokens).logits
        return torch.log_softmax(logits, -1)[:, :-1].gather(-1, tokens[:, 1:, None]).squeeze(-1), logits

    fp8_log_probs, fp8_logits = log_probs(fp8)
    _, ours = log_probs(_dequantized(fp8, str(tmp_path / "fp32"), torch.float32))
    assert torch.equal(fp8_logits, ours)
    gaps = (fp8_log_probs - log_probs(hf)[0]).abs()
    print(f"{model}: |log p(fp8) - log p(source)| max {gaps.max():.3f} mean {gaps.mean():.3f}")
    assert 0 < gaps.max() < LOGPROB_BAR[0] and gaps.mean() < LOGPROB_BAR[1], gaps


def _in_dtype(fp8_dir: str, out_dir: str, dtype: torch.dtype) -> str:
    """The block-FP8 checkpoint `fp8_dir` unchanged, its config.json naming `dtype` as the one to
    dequantize into (the training dtype the converter takes from it)."""
    os.makedirs(out_dir)
    for path in glob.glob(os.path.join(fp8_dir, "*.safetensors*")):
        os.symlink(path, os.path.join(out_dir, os.path.basename(path)))
    name = str(dtype).removeprefix("torch.")
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump({**_config(fp8_dir), "torch_dtype": name, "dtype": name}, f)
    return out_dir


def test_fp8_checkpoint_to_megatron_and_back_keeps_every_code(exports, tmp_path):
    """Block-FP8 checkpoints read straight into Megatron (dequantized into fp32 or bf16), exported
    in FP8 again: every code comes back (the training dtype's rounding is far below half an e4m3
    ulp), each scale within that rounding: the block's largest value, code 448 times the scale,
    rounded to the dtype and divided by 448 in fp32 (fp32: 2 roundings of 2^-24 relative, bf16:
    2^-8 + 2^-24), and the source's quantization_config kept. The checkpoints: this module's
    exports, and the published-layout ones (scripts/make_tiny_model.py --fp8: Qwen3-MoE experts 192
    wide, ending in partial blocks; DeepSeek-V3 with MLA's 576-row kv_a_proj_with_mqa and its MTP
    layer)."""
    from megarl.demo.tiny_checkpoint import make_named

    sources = {model: exports[model][1] for model in IN_TRANSFORMERS}
    for name in ("qwen3_moe_fp8", "deepseek_v3_fp8"):
        sources[name] = make_named(name, str(tmp_path / name))
    jobs, cases = [], []
    for model, fp8 in sources.items():
        for dtype in (torch.float32, torch.bfloat16):
            name = f"{model}_{str(dtype)[6:]}"
            source = _in_dtype(fp8, str(tmp_path / name), dtype)
            megatron, again = str(tmp_path / f"{name}_megatron"), str(tmp_path / f"{name}_fp8")
            jobs += [["hf_to_megatron", source, megatron], ["megatron_to_hf_fp8", megatron, again]]
            cases.append((fp8, again, 2 ** -23 if dtype == torch.float32 else 2 ** -8 + 2 ** -24))
    run("tests/workers/convert_models.py", "--jobs", json.dumps(jobs), nproc=1, timeout=900)
    for first, again, rounding in cases:
        a, b = _tensors(first), _tensors(again)
        assert sorted(a) == sorted(b)
        assert _config(again)["quantization_config"] == _config(first)["quantization_config"]
        codes = [n for n in a if a[n].dtype == torch.float8_e4m3fn]
        changed = sum(int((a[n].view(torch.uint8) != b[n].view(torch.uint8)).sum()) for n in codes)
        total = sum(a[n].numel() for n in codes)
        scales = [fp8_blocks.scale_name(n) for n in codes]
        drift = max(((b[n] - a[n]).abs() / a[n]).max().item() for n in scales)
        print(f"{os.path.basename(again)}: {changed} of {total} FP8 codes changed, scales within {drift:.2e}")
        assert codes and changed == 0
        assert drift <= rounding, drift
