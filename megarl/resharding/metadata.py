"""What this rank holds, as resharding Pieces, and the full-model tensor names to expect.

Owns the bridge from megarl.models.param_layout (local slots) to the pure plan: per-rank
pieces are exchanged once per run with one all_gather_object (metadata only, no tensors).
"""

import hashlib
from typing import Dict, List, Tuple

import torch
import torch.distributed as dist

from megarl.models import weight_tables
from megarl.models.hf_config import ModelArch
from megarl.models.param_layout import weight_slots
from megarl.resharding.plan import Piece


def local_pieces(chunks: List[torch.nn.Module], arch: ModelArch,
                 role: str = "policy") -> Tuple[List[Piece], Dict[Tuple[str, int], torch.Tensor]]:
    """This rank's pieces and their tensors, keyed (canonical, tp_rank). A tied output layer
    (the last stage's copy of the embedding) is left out: the embedding itself is sent."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    pieces, tensors = [], {}
    for slot, param in weight_slots(chunks):
        if weight_tables.entry_of(arch, slot.canonical, role).megatron != slot.canonical:
            continue
        tensor = param.detach()
        pieces.append(Piece(rank=rank, canonical=slot.canonical, tp_rank=slot.tp_rank,
                            tp_size=slot.tp_size, tp_dim=slot.tp_dim, glu=slot.glu,
                            shape=tuple(tensor.shape), dtype=str(tensor.dtype)))
        tensors[(slot.canonical, slot.tp_rank)] = tensor
    return pieces, tensors


_GATHERED: Dict[Tuple[int, ...], Tuple[Piece, ...]] = {}


def _digest(pieces: List[Piece]) -> int:
    """A stable 63-bit digest of one rank's pieces (Python's hash() differs per process)."""
    return int.from_bytes(hashlib.blake2b(repr(pieces).encode(), digest_size=8).digest(), "big") >> 1


def all_pieces(mine: List[Piece], device: str = "cpu") -> Tuple[Piece, ...]:
    """Every rank's pieces. The metadata itself is exchanged once per layout: each call gathers
    only one digest per rank (one small collective), and every rank sees the same digests, so
    all of them agree on whether the pieces are already known. `device`: where the default
    group's collectives run (the model's device)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return tuple(mine)
    digests = torch.zeros(dist.get_world_size(), dtype=torch.int64, device=device)
    dist.all_gather_into_tensor(digests, torch.tensor([_digest(mine)], dtype=torch.int64, device=device))
    key = tuple(digests.tolist())
    if key not in _GATHERED:
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        _GATHERED[key] = tuple(piece for rank_pieces in everyone for piece in rank_pieces)
    return _GATHERED[key]

def model_bytes(pieces: Tuple[Piece, ...]) -> int:
    """Bytes of the full model: each (tensor, TP shard) once, however many replicas hold it."""
    return sum({(p.canonical, p.tp_rank): p.nbytes for p in pieces}.values())
