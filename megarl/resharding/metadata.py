"""What this rank holds, as resharding Pieces, and the full-model tensor names to expect.

Owns the bridge from megarl.models.param_layout (local slots) to the pure plan: per-rank
pieces are exchanged once per sync with one all_gather_object (metadata only, no tensors).
"""

from typing import Dict, List, Tuple

import torch
import torch.distributed as dist

from megarl.models import weight_tables
from megarl.models.hf_config import ModelArch
from megarl.models.param_layout import param_slots
from megarl.resharding.plan import Piece


def local_pieces(chunks: List[torch.nn.Module], arch: ModelArch,
                 role: str = "policy") -> Tuple[List[Piece], Dict[Tuple[str, int], torch.Tensor]]:
    """This rank's pieces and their tensors, keyed (canonical, tp_rank). A tied output layer
    (the last stage's copy of the embedding) is left out: the embedding itself is sent."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    pieces, tensors = [], {}
    for slot, param in param_slots(chunks):
        if weight_tables.entry_of(arch, slot.canonical, role).megatron != slot.canonical:
            continue
        tensor = param.detach()
        pieces.append(Piece(rank=rank, canonical=slot.canonical, tp_rank=slot.tp_rank,
                            tp_size=slot.tp_size, tp_dim=slot.tp_dim, glu=slot.glu,
                            shape=tuple(tensor.shape), dtype=str(tensor.dtype)))
        tensors[(slot.canonical, slot.tp_rank)] = tensor
    return pieces, tensors


def all_pieces(mine: List[Piece]) -> Tuple[Piece, ...]:
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return tuple(mine)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return tuple(piece for rank_pieces in everyone for piece in rank_pieces)


def expected_tensors(arch: ModelArch, role: str = "policy") -> Tuple[str, ...]:
    return tuple(entry.megatron for entry in weight_tables.entries(arch, role))
