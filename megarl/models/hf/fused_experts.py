"""HF checkpoints that store all routed experts of a layer in one tensor (gpt-oss:
`mlp.experts.gate_up_proj` [E, H, 2I], `down_proj` [E, I, H] and their biases), and MXFP4 expert
blocks (`*_blocks` [E, rows, cols/32, 16] uint8 + `*_scales` [E, rows, cols/32] uint8).

The weight tables name one expert's slice of a fused tensor `NAME[e]`: a per-expert name like
every other family's, so conversion, loading and export stay one Megatron tensor per table row.
Owns: reading `NAME[e]` (dequantizing MXFP4 on the way), and fusing `NAME[e]` back into `NAME`
(or MXFP4 blocks and scales) on export. Does not own what the slices mean (models/weights/tables.py).
"""

import re
from typing import Dict, List, Tuple

import torch

_SLICE = re.compile(r"^(.+)\[(\d+)\]$")
# The 16 values of an FP4 (E2M1) nibble, low nibble first in each byte (OCP MX spec).
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
MX_BLOCK = 32  # values sharing one scale
MX_BIAS = 127  # the scale is a biased power of two (E8M0)


def sliced(name: str, expert: int) -> str:
    return f"{name}[{expert}]"


def split_slice(name: str) -> Tuple[str, int]:
    """`NAME[e]` -> (NAME, e); (name, -1) for a plain name."""
    match = _SLICE.match(name)
    return (match.group(1), int(match.group(2))) if match else (name, -1)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """blocks [..., R, G, 16] uint8, scales [..., R, G] uint8 -> fp32 [..., R, G * 32], transposed
    to [..., G * 32, R]: the layout of HF's dequantized gpt-oss experts (x @ W). Exact: every
    value is an FP4 value times a power of two."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8 or blocks.shape[:-1] != scales.shape:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} {blocks.dtype} and scales "
                         f"{tuple(scales.shape)} {scales.dtype}: expected uint8 [..., G, 16] and [..., G]")
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32)
    values = torch.stack([lut[(blocks & 0x0F).long()], lut[(blocks >> 4).long()]], dim=-1)
    values = values.reshape(*blocks.shape[:-1], MX_BLOCK)
    values = torch.ldexp(values, scales.to(torch.int32)[..., None] - MX_BIAS)
    return values.reshape(*values.shape[:-2], -1).transpose(-2, -1).contiguous()


def quantize_mxfp4(weight: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """fp32 [..., C, R] -> MXFP4 blocks [..., R, C/32, 16] and scales [..., R, C/32], the inverse
    of dequantize_mxfp4. The OCP MX rule: a block's scale is 2^(floor(log2(amax)) - 2), FP4's
    largest exponent; each value rounds to the nearest FP4 value, saturating at 6. Values
    dequantized from MXFP4 so made come back bit for bit (their block maximum is 4 or 6 times the
    scale)."""
    rows = weight.float().transpose(-2, -1)  # [..., R, C]
    if rows.shape[-1] % MX_BLOCK:
        raise ValueError(f"MXFP4 export needs a last dim divisible by {MX_BLOCK}, got {rows.shape[-1]}")
    blocks = rows.reshape(*rows.shape[:-1], -1, MX_BLOCK)  # [..., R, G, 32]
    amax = blocks.abs().amax(-1)
    exponent = torch.where(amax > 0, torch.floor(torch.log2(amax)) - 2, torch.full_like(amax, -MX_BIAS))
    exponent = exponent.clamp(-MX_BIAS, MX_BIAS + 1)
    scaled = torch.ldexp(blocks, -exponent.to(torch.int32)[..., None]).clamp(-6.0, 6.0)
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32)
    codes = (scaled[..., None] - lut).abs().argmin(-1).to(torch.uint8)  # nearest; +0 before -0
    codes = torch.where((scaled == 0) & torch.signbit(scaled), torch.full_like(codes, 8), codes)
    pairs = codes.reshape(*codes.shape[:-1], MX_BLOCK // 2, 2)
    packed = (pairs[..., 0] | (pairs[..., 1] << 4)).to(torch.uint8)
    return packed.contiguous(), (exponent + MX_BIAS).to(torch.uint8).contiguous()


MXFP4_CONFIG = {"quant_method": "mxfp4", "modules_to_not_convert": [
    "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}


def export_config(hf_config: Dict, mxfp4: bool) -> Dict:
    """config.json of an export: unquantized (no quantization_config), or with MXFP4 experts (the
    source's quantization_config where it was MXFP4, else gpt-oss's published one)."""
    config = {k: v for k, v in hf_config.items() if k != "quantization_config"}
    if mxfp4:
        source = hf_config.get("quantization_config") or {}
        published = source.get("quant_method") == "mxfp4"
        config["quantization_config"] = source if published else dict(MXFP4_CONFIG)
    return config


class FusedExpertsReader:
    """A SafetensorsReader seen through per-expert names: each fused expert tensor `NAME` (or its
    MXFP4 `NAME_blocks` + `NAME_scales`) reads as NAME[0] ... NAME[E-1]. Holds one fused tensor at
    a time per kind (the experts of a layer are read together)."""

    def __init__(self, reader, fused: Tuple[str, ...]):
        self._reader = reader
        self._fused = fused  # suffixes of fused tensors, e.g. "mlp.experts.gate_up_proj"
        self._cached: Dict[str, torch.Tensor] = {}
        self.weight_map = dict(reader.weight_map)
        self._counts: Dict[str, int] = {}
        for name in list(self.weight_map):
            base = name[:-len("_blocks")] if name.endswith("_blocks") else name
            if base.endswith(self._fused):
                experts = self._experts(name)
                shard = self.weight_map.pop(name)
                self.weight_map.pop(base + "_scales", None)
                self._counts[base] = experts
                self.weight_map.update({sliced(base, e): shard for e in range(experts)})

    def _experts(self, name: str) -> int:
        handle = self._reader._open(self._reader.weight_map[name])
        return handle.get_slice(name).get_shape()[0]

    @property
    def reads(self) -> int:
        return self._reader.reads

    def names(self) -> List[str]:
        return list(self.weight_map)

    def _full(self, base: str) -> torch.Tensor:
        if base not in self._cached:
            if len(self._cached) >= len(self._fused):  # a new layer: drop the last one's
                self._cached.clear()
            if base + "_blocks" in self._reader.weight_map:
                full = dequantize_mxfp4(self._reader(base + "_blocks"), self._reader(base + "_scales"))
            else:
                full = self._reader(base)
            self._cached[base] = full
        return self._cached[base]

    def __call__(self, name: str) -> torch.Tensor:
        base, expert = split_slice(name)
        if expert < 0:
            return self._reader(name)
        if base not in self._counts:
            raise KeyError(f"tensor {base!r} is missing from the HF checkpoint")
        return self._full(base)[expert]

    def close(self):
        self._reader.close()


def fuse(tensors: Dict[str, torch.Tensor], mxfp4: Tuple[str, ...] = ()) -> Dict[str, torch.Tensor]:
    """Per-expert `NAME[e]` tensors -> stacked `NAME` [E, ...] (every expert must be there); those
    whose NAME ends with one of `mxfp4` as MXFP4 `NAME_blocks` and `NAME_scales`."""
    out, groups = {}, {}
    for name, tensor in tensors.items():
        base, expert = split_slice(name)
        if expert < 0:
            out[name] = tensor
        else:
            groups.setdefault(base, {})[expert] = tensor
    for base, by_expert in groups.items():
        if sorted(by_expert) != list(range(len(by_expert))):
            raise ValueError(f"{base}: experts {sorted(by_expert)} are not all of 0..E-1; fuse the "
                             "full model's tensors")
        full = torch.stack([by_expert[e] for e in range(len(by_expert))])
        if base.endswith(mxfp4) and mxfp4:
            out[base + "_blocks"], out[base + "_scales"] = quantize_mxfp4(full)
        else:
            out[base] = full
    return out
