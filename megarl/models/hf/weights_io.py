"""Move weights between HF safetensors checkpoints and a live, sharded Megatron model.

Owns: streaming HF tensors into this rank's shards (one full tensor in memory at a time; each
rank reads only what it holds), and producing HF tensors from this rank's shards. Does not own
Megatron's own checkpoint format (see `checkpoint.py`), name tables (`models/weights/tables.py`) or
reading the safetensors files (`safetensors_reader.py`).
"""

from typing import Callable, Dict, Iterator, List, Tuple

import torch
import torch.distributed as dist

from megarl.models.hf.config import ModelArch
from megarl.models.hf.fp8_reader import dequantizing
from megarl.models.hf.fused_experts import FusedExpertsReader, fuse
from megarl.models.hf.safetensors_reader import SafetensorsReader
from megarl.models.megatron.param_layout import ParamSlot, join_shards, local_shard, param_slots, weight_slots
from megarl.models.weights import mtp as mtp_weights
from megarl.models.weights import tables as weight_tables
from megarl.parallel_state import megatron_groups


def check_hf_names(arch: ModelArch, names: List[str], hf_dir: str, role: str = "policy") -> None:
    """Every tensor of the checkpoint must be one the weight table consumes: an unknown name
    means a config field megarl does not model, and dropping it would change the model."""
    known = {h for entry in weight_tables.entries(arch, role) for h in entry.hf}
    known.update(mtp_weights.mtp_names(arch, names))  # kept aside, not trained (models/weights/mtp.py)
    if arch.tie_embeddings or role == "value":
        # Tied checkpoints may store the shared matrix twice; a critic started from a policy
        # checkpoint drops its LM head.
        known.add("lm_head.weight")
    unknown = sorted(set(names) - known)
    if unknown:
        raise ValueError(
            f"{hf_dir!r} has {len(unknown)} tensors the {arch.family} table does not know, e.g. "
            f"{unknown[:5]}; the checkpoint does not match its config.json or the family"
        )


def open_hf(hf_dir: str, arch: ModelArch):
    """The checkpoint's reader: block-FP8 weights dequantized into the model's dtype, per expert
    where the family fuses its experts (gpt-oss)."""
    reader = dequantizing(SafetensorsReader(hf_dir), arch, hf_dir)
    fused = weight_tables.FUSED_EXPERTS.get(arch.family)
    return FusedExpertsReader(reader, fused) if fused else reader


@torch.no_grad()
def load_hf_weights(chunks: List[torch.nn.Module], arch: ModelArch, hf_dir: str,
                    role: str = "policy") -> Tuple[int, int]:
    """Fill this rank's shards from the HF checkpoint; return (parameters written, HF tensors
    read) on this rank.
    The value head, which a causal-LM checkpoint does not have, keeps its initialization."""
    reader = open_hf(hf_dir, arch)
    check_hf_names(arch, reader.names(), hf_dir, role)
    tp = megatron_groups.tensor().size
    written = 0
    try:
        for slot, param in weight_slots(chunks):
            entry = weight_tables.entry_of(arch, slot.canonical, role)
            if entry.hf == weight_tables.VALUE_HEAD.hf and entry.hf[0] not in reader.weight_map:
                continue
            full = weight_tables.read_entry(arch, entry, reader, tp)
            shard = local_shard(full, slot)
            if shard.shape != param.shape:
                raise ValueError(
                    f"{entry.hf} -> {slot.canonical}: shard shape {tuple(shard.shape)} does not "
                    f"match the model's {tuple(param.shape)}; the HF config and weights disagree"
                )
            param.copy_(shard)
            written += 1
    finally:
        reader.close()
    return written, reader.reads


def local_hf_tensors(chunks: List[torch.nn.Module], arch: ModelArch, role: str = "policy",
                     tensor_of: Callable[[torch.nn.Parameter], torch.Tensor] = None
                     ) -> Iterator[Tuple[str, torch.Tensor]]:
    """HF tensors of this rank's parameters; valid only where nothing is TP-sharded (tp=etp=1),
    as in the converter's layout. `tensor_of` picks what to export (default: the weights)."""
    for slot, param in weight_slots(chunks):
        if slot.tp_dim is not None:
            raise ValueError(f"{slot.canonical} is TP-sharded; export needs tp = etp = 1 "
                             f"(use gather_hf_tensors for a sharded layout)")
        if weight_tables.tied_output(arch, slot.canonical, role):
            continue
        tensor = param.detach() if tensor_of is None else tensor_of(param)
        entry = weight_tables.entry_of(arch, slot.canonical, role)
        yield from weight_tables.to_hf(arch, entry, tensor).items()


def gather_hf_tensors(chunks: List[torch.nn.Module], arch: ModelArch, role: str = "policy",
                      tensor_of: Callable[[torch.nn.Parameter], torch.Tensor] = None
                      ) -> Dict[str, torch.Tensor]:
    """Every HF tensor of the full model, on every rank, from shards at any layout.

    For verification and small models only: each rank ends up holding the whole model. The
    weight-sync path to vLLM streams instead (megarl.resharding)."""
    mine = []
    # Weight buffers (the expert bias) have weights but no gradients.
    for slot, param in (weight_slots if tensor_of is None else param_slots)(chunks):
        if weight_tables.tied_output(arch, slot.canonical, role):
            continue
        tensor = param.detach() if tensor_of is None else tensor_of(param)
        # A copy: once DDP owns the parameters each one is a view of its whole buffer, and
        # pickling a view sends the whole storage (measured: 27 s and 11 GB per rank at 20M).
        mine.append((slot, tensor.detach().cpu().clone()))
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    shards: Dict[str, Dict[int, torch.Tensor]] = {}
    slot_of: Dict[str, ParamSlot] = {}
    for rank_items in everyone:
        for slot, tensor in rank_items:
            # DP and CP replicas hold identical copies; one per TP rank is enough.
            shards.setdefault(slot.canonical, {}).setdefault(slot.tp_rank, tensor)
            slot_of[slot.canonical] = slot
    result = {}
    for canonical, by_rank in shards.items():
        slot = slot_of[canonical]
        full = join_shards([by_rank[r] for r in range(slot.tp_size if slot.tp_dim is not None
                                                      else 1)], slot.tp_dim, slot.glu, slot.sections)
        result.update(weight_tables.to_hf(arch, weight_tables.entry_of(arch, slot.canonical, role), full))
    return fuse(result)
