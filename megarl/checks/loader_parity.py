"""Weight-level check of a sync, independent of kernels and dtype: the tensors the engine's
kernels use after megarl's sync, against the same weights loaded by vLLM's own loaders (from an
HF export of the actor). Every element the sync writes must be where vLLM's loader puts it, and
processed the same way, so the difference is 0 in any dtype; a log-prob comparison cannot say as
much in bf16, where vLLM's kernels and Megatron's differ by rounding.

On the CPU, vLLM 0.32's reload leaves MoE experts unprepared (VLLMEngine.load_hf_weights), so
there the check holds for dense models only. Collective; the ranks share a filesystem (one node).
"""

import os
import shutil
import tempfile
from typing import Iterable, List, Optional, Tuple

import torch
import torch.distributed as dist

from megarl.models.hf import fp8_blocks
from megarl.models.hf.config import ModelArch, load_hf_config
from megarl.models.hf.safetensors_reader import SafetensorsReader
from megarl.resharding.hf_export import export_hf


def as_fp8_checkpoint(named: Iterable[Tuple[str, torch.Tensor]], quantization_config: dict):
    """The tensors of an HF checkpoint as its block-FP8 version stores them: each tensor the
    format quantizes as codes and NAME_scale_inv (models/hf/fp8_blocks.py), the rest as they are."""
    block = fp8_blocks.block_size(quantization_config)
    for name, tensor in named:
        if fp8_blocks.is_quantized(name, tuple(tensor.shape), quantization_config):
            codes, scale = fp8_blocks.quantize(tensor, block)
            yield name, codes
            yield fp8_blocks.scale_name(name), scale
        else:
            yield name, tensor


def loader_parity(engine, chunks: List[torch.nn.Module], arch: ModelArch, hf_dir: str,
                  quantization_config: Optional[dict] = None) -> dict:
    """{"weight_parity_max_abs_diff", "weight_parity_worst", "weight_parity_tensors"}: the
    largest difference over this rank's engine tensors and where it is. Leaves the engine holding
    the reloaded weights (the same values). `quantization_config`: a block-FP8 engine's; its
    loader then takes the export as that FP8 checkpoint stores it (as_fp8_checkpoint), and
    "weight_parity_fp8_tensors" counts the FP8 codes and scales compared."""
    synced = engine.live_weights()
    root = [tempfile.mkdtemp(prefix="megarl_loader_parity_") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(root, src=0)
    export = export_hf(chunks, arch, load_hf_config(hf_dir), hf_dir, os.path.join(root[0], "hf"))
    reader = SafetensorsReader(export)
    named = ((name, reader(name)) for name in reader.names())
    if quantization_config:
        named = as_fp8_checkpoint(named, quantization_config)
    report = engine.load_hf_weights(named)
    reader.close()
    if report.missing or report.unexpected:
        raise RuntimeError(f"vLLM's loader did not take the export: missing {report.missing[:3]}, "
                           f"unexpected {report.unexpected[:3]}")
    reloaded = engine.live_weights()
    if set(synced) != set(reloaded):
        raise RuntimeError(f"engine tensors changed names: {sorted(set(synced) ^ set(reloaded))[:3]}")
    diffs = {name: float((synced[name].double() - reloaded[name].double()).abs().max())
             for name in synced if synced[name].numel()}
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(root[0])
    worst = max(diffs, key=diffs.get)
    fp8 = [name for name in diffs
           if synced[name].dtype == fp8_blocks.FP8_DTYPE or name.endswith("_scale_inv")]
    return {"weight_parity_max_abs_diff": diffs[worst], "weight_parity_worst": worst,
            "weight_parity_tensors": len(diffs), "weight_parity_fp8_tensors": len(fp8)}
