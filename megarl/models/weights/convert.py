"""HF checkpoint <-> Megatron distributed checkpoint, run on any number of ranks.

Owns the two conversions behind scripts/convert.py's two directions. Both use
ParallelDims.for_conversion: each rank is a pipeline stage (fewer layers on the first and last when
the count does not split evenly), so each rank reads, holds and writes only its own layers (one HF
tensor in flight at a time), and the written checkpoint loads at any layout. Each returns its
`notes`: what it carried as absent (MTP weights a config declares and the checkpoint lacks:
models/weights/mtp.py).
"""

import json
import os
import shutil

import torch.distributed as dist
from safetensors.torch import save_file

from megarl.models.hf import fp8_blocks
from megarl.models.hf.config import arch_from_hf_config, load_hf_config
from megarl.models.hf.fused_experts import export_config, fuse
from megarl.models.hf.safetensors_reader import SafetensorsReader
from megarl.models.hf.tokenizer_files import TOKENIZER_ASSETS
from megarl.models.hf.weights_io import load_hf_weights, local_hf_tensors
from megarl.models.megatron.builder import build_model
from megarl.models.weights import checkpoint
from megarl.models.weights import mtp as mtp_weights
from megarl.models.weights import tables as weight_tables
from megarl.parallel_state import megatron_groups
from megarl.parallel_state.dims import ParallelDims


def _fresh_output(out_dir: str) -> str:
    """Write into OUT.partial and rename at the end: a half-written OUT never exists."""
    partial = out_dir.rstrip("/") + ".partial"
    if dist.get_rank() == 0:
        shutil.rmtree(partial, ignore_errors=True)
        os.makedirs(partial)
    dist.barrier()
    return partial


def _finish(partial: str, out_dir: str) -> None:
    dist.barrier()
    if dist.get_rank() == 0:
        os.rename(partial, out_dir)
    dist.barrier()


def _start(hf_config: dict, out_dir: str):
    """Validate, join the world, and build the empty model in the conversion layout."""
    if os.path.exists(out_dir):  # before any work, so nothing is lost
        raise FileExistsError(f"output {out_dir!r} already exists; remove it or pick another path")
    arch = arch_from_hf_config(hf_config)
    world = megatron_groups.init_distributed()
    dims = ParallelDims.for_conversion(world, arch.num_layers)
    megatron_groups.initialize(dims)
    partial = _fresh_output(out_dir)
    return arch, dims, partial, build_model(arch, dims, perform_initialization=False)


def hf_to_megatron(hf_dir: str, out_dir: str) -> dict:
    hf_config = load_hf_config(hf_dir)
    arch, dims, partial, chunks = _start(hf_config, out_dir)
    world = dims.world_size
    _, reads = load_hf_weights(chunks, arch, hf_dir)
    checkpoint.save(chunks, partial, hf_config, hf_dir=hf_dir)
    notes = []
    if dist.get_rank() == 0:
        kept = mtp_weights.keep_in_assets(arch, hf_dir, os.path.join(partial, checkpoint.ASSETS_DIR))
        notes = mtp_weights.absent_notes(arch, kept, hf_dir)
    _finish(partial, out_dir)
    reads_per_rank = [None] * world
    dist.all_gather_object(reads_per_rank, reads)
    return {"out": out_dir, "family": arch.family, "layout": dims.describe(),
            "hf_tensors_in_checkpoint": _count_tensors(hf_dir),
            "hf_tensors_read_per_rank": reads_per_rank, "notes": _from_rank0(notes)}


def _from_rank0(notes: list) -> list:
    """Rank 0 wrote the MTP files and knows the notes; every rank returns the same result."""
    box = [notes]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _count_tensors(hf_dir: str) -> int:
    reader = SafetensorsReader(hf_dir)
    count = len(reader.names())
    reader.close()
    return count


EXPERT_FORMATS = ("unquantized", "mxfp4")


def megatron_to_hf(megatron_dir: str, out_dir: str, experts: str = "unquantized",
                   dtype: str = "auto") -> dict:
    """`experts`: the routed experts in the model's dtype, or as MXFP4 blocks and scales (gpt-oss).
    `dtype`: the weights in the model's dtype (auto), or block FP8 (fp8: models/hf/fp8_blocks.py)."""
    source_config = checkpoint.read_model_file(megatron_dir)["hf_config"]
    family = arch_from_hf_config(source_config).family
    if experts not in EXPERT_FORMATS or (experts == "mxfp4" and family not in weight_tables.MXFP4_EXPERTS):
        raise ValueError(f"--experts {experts}: {family} exports its experts as one of "
                         f"{['unquantized', *(['mxfp4'] if family in weight_tables.MXFP4_EXPERTS else [])]}")
    weight_tables.check_export_dtype(family, dtype, "--dtype")
    mxfp4 = weight_tables.MXFP4_EXPERTS[family] if experts == "mxfp4" else ()
    hf_config = export_config(source_config, bool(mxfp4))
    quantize = fp8_blocks.quantizer(source_config.get("quantization_config")) if dtype == "fp8" else None
    arch, dims, partial, chunks = _start(hf_config, out_dir)
    world = dims.world_size
    checkpoint.load(chunks, megatron_dir)
    stage, stages = megatron_groups.pipeline().rank, dims.pp
    filename = f"model-{stage + 1:05d}-of-{stages:05d}.safetensors"
    names = []
    if megatron_groups.data().rank == 0:  # one writer per pipeline stage
        tensors = fuse({name: t.contiguous() for name, t in local_hf_tensors(chunks, arch)}, mxfp4)
        if quantize:
            tensors = quantize(tensors)
        save_file(tensors, os.path.join(partial, filename), metadata={"format": "pt"})
        names = sorted(tensors)
    all_names = [None] * world
    dist.all_gather_object(all_names, (filename, names))
    notes = []
    if dist.get_rank() == 0:
        weight_map = {name: file for file, file_names in all_names for name in file_names}
        assets = os.path.join(megatron_dir, checkpoint.ASSETS_DIR)
        mtp = mtp_weights.restore(arch, assets if os.path.isdir(assets) else None, partial, quantize)
        notes = mtp_weights.absent_notes(arch, len(mtp), megatron_dir)
        weight_map.update(mtp)
        total_size = sum(os.path.getsize(os.path.join(partial, f)) for f in set(weight_map.values()))
        with open(os.path.join(partial, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": total_size}, "weight_map": weight_map}, f,
                      indent=2, sort_keys=True)
        if quantize:
            hf_config = fp8_blocks.export_config(source_config, weight_map)  # the MTP layers' too
        with open(os.path.join(partial, "config.json"), "w") as f:
            json.dump(hf_config, f, indent=2)
        if os.path.isdir(assets):
            for name in os.listdir(assets):
                if name in TOKENIZER_ASSETS:
                    shutil.copy2(os.path.join(assets, name), partial)
    _finish(partial, out_dir)
    return {"out": out_dir, "family": arch.family, "layout": dims.describe(), "notes": _from_rank0(notes)}
