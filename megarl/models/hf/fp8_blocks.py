"""Block-FP8 weights as DeepSeek-V3, Kimi-K2 and the Qwen3 `-FP8` releases publish them.

A 2-D weight [m, n] is stored as float8 e4m3 codes of the same shape plus one fp32 scale per
128 x 128 block (`weight_scale_inv`, [ceil(m/128), ceil(n/128)]; the last blocks along each
dimension may be partial). Dequantized, a code times its block's scale is the weight.

Owns: the quantizer and the dequantizer (pure functions), reading the config's
`quantization_config` and writing an export's, which HF tensors a checkpoint quantizes, and
turning an export's tensors into a block-FP8 checkpoint's. Does not own streaming shards
(safetensors_reader.py) or writing files (models/weights/convert.py, resharding/hf_export.py).
"""

import functools
from typing import Callable, Dict, Iterable, Optional, Tuple

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite e4m3 value
BLOCK = (128, 128)
# Where a zero block's scale would be 0 (and its codes 0/0), the reference clamps amax: the
# codes of a zero block stay 0 and its scale is 1e-4 / 448.
AMAX_FLOOR = 1e-4


def scale_shape(shape: Tuple[int, int], block: Tuple[int, int]) -> Tuple[int, int]:
    """The block grid of a 2-D weight: the shape of its weight_scale_inv."""
    return -(-shape[0] // block[0]), -(-shape[1] // block[1])


def quantize(weight: torch.Tensor, block: Tuple[int, int] = BLOCK) -> Tuple[torch.Tensor, torch.Tensor]:
    """(codes, scale_inv) of a 2-D weight, bit for bit DeepGEMM's per_block_cast_to_fp8 (the
    quantizer vLLM, slime and Miles use at weight sync): per block, scale = max(amax, 1e-4) / 448
    in fp32, codes = round-to-nearest e4m3 of weight * (1 / scale)."""
    if weight.dim() != 2:
        raise ValueError(f"block FP8 quantizes 2-D weights; got shape {tuple(weight.shape)}")
    m, n = weight.shape
    rows, cols = scale_shape((m, n), block)
    padded = weight.new_zeros(rows * block[0], cols * block[1])
    padded[:m, :n] = weight
    view = padded.view(rows, block[0], cols, block[1])
    amax = view.abs().float().amax(dim=(1, 3), keepdim=True).clamp(AMAX_FLOOR)
    scale = amax / FP8_MAX
    codes = (view * (1.0 / scale)).to(FP8_DTYPE)
    return codes.view_as(padded)[:m, :n].contiguous(), scale.view(rows, cols)


def dequantize(codes: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype = torch.float32,
               block: Tuple[int, int] = BLOCK) -> torch.Tensor:
    """The weight a block-FP8 tensor stands for: each code times its block's scale, in fp32,
    then cast to `dtype`."""
    if codes.dim() != 2:
        raise ValueError(f"block FP8 weights are 2-D; got codes of shape {tuple(codes.shape)}")
    expected = scale_shape(tuple(codes.shape), block)
    if tuple(scale_inv.shape) != expected:
        raise ValueError(f"weight_scale_inv of shape {tuple(scale_inv.shape)} does not match codes "
                         f"of shape {tuple(codes.shape)} in {block[0]}x{block[1]} blocks (expected "
                         f"{expected}); the checkpoint's weight_block_size differs from its tensors")
    m, n = codes.shape
    scales = scale_inv.float().repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)[:m, :n]
    return (codes.float() * scales).to(dtype)


def block_size(quantization_config: Optional[Dict]) -> Optional[Tuple[int, int]]:
    """The block size of a block-FP8 checkpoint's quantization_config; None when unquantized.
    Any other format is refused, naming it and what to do."""
    if not quantization_config:
        return None
    method = quantization_config.get("quant_method")
    if method != "fp8":
        advice = {
            "compressed-tensors": "compressed-tensors checkpoints (e.g. Kimi-K2-Thinking's INT4 "
                                  "W4A16) are not read yet: dequantize to bf16 first",
            "mxfp4": "MXFP4 is gpt-oss's format and read for gpt-oss only",
        }.get(method, "megarl reads block-FP8 (quant_method fp8 with weight_block_size) or "
                      "unquantized checkpoints: dequantize to bf16 first")
        raise ValueError(f"config.json quantization_config.quant_method = {method!r} is not "
                         f"supported: {advice}")
    fmt = quantization_config.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ValueError(f"config.json quantization_config.fmt = {fmt!r} is not supported: block "
                         "FP8 checkpoints are read in e4m3 only")
    size = quantization_config.get("weight_block_size")
    if not size:
        raise ValueError("config.json quantization_config has quant_method 'fp8' but no "
                         "weight_block_size: per-tensor and per-channel FP8 are not read yet, "
                         "only block FP8 (weight_block_size [128, 128]); dequantize to bf16 first")
    if len(size) != 2 or any(int(s) <= 0 for s in size):
        raise ValueError(f"config.json quantization_config.weight_block_size = {size!r}: expected "
                         "two positive sizes, e.g. [128, 128]")
    scheme = quantization_config.get("activation_scheme", "dynamic")
    if scheme != "dynamic":
        raise ValueError(f"config.json quantization_config.activation_scheme = {scheme!r} is not "
                         "supported: block FP8 with static activation scales is not read yet")
    return int(size[0]), int(size[1])


# Tensors a block-FP8 checkpoint keeps in bf16 whatever its modules_to_not_convert says: the
# embeddings, the output layer (lm_head; DeepSeek's MTP shared_head.head), the norms, the routers.
_KEPT_IN_BF16 = ("embed_tokens.", "lm_head.", "shared_head.head.", "norm.", "layernorm.",
                 "mlp.gate.", "block_sparse_moe.gate.")  # the last: Mixtral's router


def is_quantized(name: str, shape: Tuple[int, ...], quantization_config: Dict) -> bool:
    """Whether the block-FP8 checkpoint of `quantization_config` stores the HF tensor `name` as
    codes + `NAME_scale_inv`: the 2-D linear weights, except the bf16 tensors above and the
    modules the config lists in modules_to_not_convert (DeepSeek's and Qwen3's `-FP8` configs
    name lm_head and the routers there)."""
    if not name.endswith(".weight") or len(shape) != 2:
        return False
    module = name[:-len(".weight")]
    if any(part in name for part in _KEPT_IN_BF16):
        return False
    skipped = quantization_config.get("modules_to_not_convert") or []
    return not any(module == s or module.startswith(s + ".") or module.endswith("." + s) for s in skipped)


def scale_name(name: str) -> str:
    """The scale tensor beside a quantized weight: `X.weight` -> `X.weight_scale_inv`."""
    return name + "_scale_inv"


# config.json's quantization_config of an FP8 export, as DeepSeek-V3 and the Qwen3 `-FP8` releases
# publish it (export_quantization_config adds the modules kept in bf16).
FP8_CONFIG = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
              "weight_block_size": [BLOCK[0], BLOCK[1]]}
# The linear layers among the bf16 tensors above. vLLM's Fp8Config and transformers' FP8 loader
# quantize every linear layer the config does not list (Qwen3-MoE's and Mixtral's routers among
# them) and would then look for scales the checkpoint does not have; the embeddings and norms are
# not linear layers and need no listing.
_LINEAR_IN_BF16 = ("lm_head.", "shared_head.head.", "mlp.gate.", "block_sparse_moe.gate.")
# Kept in fp32 as published (DeepSeek-V3's routing bias; Megatron's expert_bias is fp32 too).
KEPT_IN_FP32 = ("e_score_correction_bias",)


def export_quantization_config(source: Optional[Dict], names: Iterable[str]) -> Dict:
    """The quantization_config of a block-FP8 export whose tensors are `names` (the unquantized HF
    names): the source checkpoint's where it was block FP8 (its modules_to_not_convert included),
    else FP8_CONFIG listing the linear layers kept in bf16 in modules_to_not_convert, as the
    Qwen3 `-FP8` releases do."""
    if source and block_size(source) is not None:
        return dict(source)
    kept = sorted({name[:-len(".weight")] for name in names
                   if name.endswith(".weight") and any(part in name for part in _LINEAR_IN_BF16)})
    return {**FP8_CONFIG, "modules_to_not_convert": kept}


def quantize_tensors(tensors: Dict[str, torch.Tensor], quantization_config: Dict) -> Dict[str, torch.Tensor]:
    """HF tensors in the model's dtype -> a block-FP8 checkpoint's: each tensor is_quantized names
    as its e4m3 codes and fp32 `NAME_scale_inv`, the routing bias in fp32, every other tensor in
    bf16. Quantized from the tensor as given (fp32 or bf16), not from a bf16 copy. Codes and
    scales already there (MTP layers copied from a block-FP8 source as they were) pass unchanged."""
    block = block_size(quantization_config)
    out = {}
    for name, tensor in tensors.items():
        if tensor.dtype == FP8_DTYPE or scale_name(name) in tensors or name.endswith("_scale_inv"):
            out[name] = tensor
        elif is_quantized(name, tuple(tensor.shape), quantization_config):
            out[name], out[scale_name(name)] = quantize(tensor, block)
        elif name.endswith(KEPT_IN_FP32):
            out[name] = tensor.float()
        else:
            out[name] = tensor.to(torch.bfloat16)
    return out


def quantizer(source: Optional[Dict]) -> Callable[[Dict[str, torch.Tensor]], Dict[str, torch.Tensor]]:
    """quantize_tensors for an export whose source checkpoint had the quantization_config `source`:
    a block-FP8 source's modules_to_not_convert decide which tensors are quantized; otherwise
    is_quantized's own rule does (the modules FP8_CONFIG lists are among its bf16 ones)."""
    return functools.partial(quantize_tensors, quantization_config=export_quantization_config(source, ()))


def export_config(hf_config: Dict, names: Iterable[str]) -> Dict:
    """config.json of a block-FP8 export whose tensors are `names`: its quantization_config
    (export_quantization_config), and bf16 as the dtype of the tensors left unquantized."""
    config = {k: v for k, v in hf_config.items() if k != "quantization_config"}
    config["quantization_config"] = export_quantization_config(hf_config.get("quantization_config"), names)
    config["torch_dtype"] = "bfloat16"
    if "dtype" in config:  # newer transformers write this key, and read it before torch_dtype
        config["dtype"] = "bfloat16"
    return config
