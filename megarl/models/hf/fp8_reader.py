"""Reading a block-FP8 checkpoint (DeepSeek-V3/R1, Kimi-K2, the Qwen3 `-FP8` releases) as if it
were unquantized: each FP8 weight reads as one tensor in the training dtype, its
`weight_scale_inv` hidden.

Owns: checking the codes and scales against each other from the safetensors headers (before any
tensor is read) and dequantizing one weight at a time. Does not own the block math
(fp8_blocks.py) or opening the shards (safetensors_reader.py).
"""

from typing import List, Tuple

import torch

from megarl.models.hf import fp8_blocks
from megarl.models.hf.config import ModelArch

_SCALE = "_scale_inv"
_FP8_HEADER_DTYPES = ("F8_E4M3",)  # safetensors' name for float8_e4m3fn


class Fp8BlocksReader:
    """A SafetensorsReader seen through dequantized names: a weight stored as float8 codes +
    `NAME_scale_inv` reads as the weight in `dtype`; the scales are not among its names. Which
    weights are quantized is what the checkpoint holds (the scale beside it), not a rule about
    names: releases differ in what they leave in bf16. Holds no tensor between calls."""

    def __init__(self, reader, block: Tuple[int, int], dtype: torch.dtype, where: str):
        self._reader = reader
        self._block = block
        self._dtype = dtype
        source = reader.weight_map
        self._scaled = {name[:-len(_SCALE)] for name in source if name.endswith(_SCALE)}
        orphans = sorted(name + _SCALE for name in self._scaled if name not in source)
        if orphans:
            raise ValueError(f"{where!r}: {len(orphans)} FP8 scales without their weight, e.g. "
                             f"{orphans[:3]}; the checkpoint is incomplete: copy it again")
        self.weight_map = {name: shard for name, shard in source.items()
                           if not (name.endswith(_SCALE) and name[:-len(_SCALE)] in source)}
        self._check_headers(where)

    def _header(self, name: str):
        return self._reader._open(self._reader.weight_map[name]).get_slice(name)

    def _check_headers(self, where: str) -> None:
        """Every scaled weight is 2-D e4m3 with one scale per block, and no FP8 tensor lacks its
        scale: refused here, from the headers, before any tensor is read or written."""
        # shard by shard: the reader maps one shard at a time
        for name in sorted(self.weight_map, key=lambda n: (self.weight_map[n], n)):
            codes = self._header(name)
            fp8 = codes.get_dtype() in _FP8_HEADER_DTYPES
            if name not in self._scaled:
                if fp8:
                    raise ValueError(f"{where!r}: {name} is stored as {codes.get_dtype()} without "
                                     f"{name}{_SCALE}; megarl reads block FP8 (a scale per "
                                     f"{self._block[0]}x{self._block[1]} block): dequantize to bf16 first")
                continue
            shape = tuple(codes.get_shape())
            if not fp8 or len(shape) != 2:
                raise ValueError(f"{where!r}: {name} has a {_SCALE} but is {codes.get_dtype()} of "
                                 f"shape {shape}; block FP8 weights are 2-D F8_E4M3 (float8_e4m3fn)")
            scale = tuple(self._header(name + _SCALE).get_shape())
            expected = fp8_blocks.scale_shape(shape, self._block)
            if scale != expected:
                raise ValueError(f"{where!r}: {name}{_SCALE} has shape {scale}, but {name} of shape "
                                 f"{shape} in the config's {self._block[0]}x{self._block[1]} blocks "
                                 f"(quantization_config.weight_block_size) needs {expected}; the "
                                 "weights and config.json disagree")

    @property
    def reads(self) -> int:
        return self._reader.reads

    def names(self) -> List[str]:
        return list(self.weight_map)

    def __call__(self, name: str) -> torch.Tensor:
        if name not in self._scaled:
            return self._reader(name)
        codes, scale = self._reader(name), self._reader(name + _SCALE)
        # One block row at a time: the fp32 products of a whole 18432 x 7168 expert would be
        # 0.5 GB beside the result; a strip of 128 rows is 3.5 MB.
        rows = self._block[0]
        out = torch.empty(codes.shape, dtype=self._dtype)
        for i in range(scale.shape[0]):
            strip = slice(i * rows, (i + 1) * rows)
            out[strip] = fp8_blocks.dequantize(codes[strip], scale[i:i + 1], self._dtype, self._block)
        return out

    def close(self):
        self._reader.close()


def dequantizing(reader, arch: ModelArch, where: str):
    """`reader` as the model reads it: through Fp8BlocksReader where the checkpoint is block FP8
    (the conversion, the live load and the MTP layers kept aside all read this way)."""
    if not arch.fp8_block:
        return reader
    return Fp8BlocksReader(reader, arch.fp8_block, arch.torch_dtype, where)
