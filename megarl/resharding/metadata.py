"""What this rank holds, as resharding Pieces, and the full-model tensor names to expect.

Owns the bridge from megarl.models.megatron.param_layout (local slots) to the pure plan: per-rank
pieces are exchanged once per run with one all_gather_object (metadata only, no tensors), over
the sync's Links (parallel_state/links.py).
"""

import hashlib
from dataclasses import dataclass, field
from typing import Dict, List, Tuple

import torch

from megarl.models.hf.config import ModelArch
from megarl.models.lora import adapters as lora
from megarl.models.megatron.param_layout import weight_slots
from megarl.models.weights import tables as weight_tables
from megarl.parallel_state.links import Links
from megarl.resharding.plan import Piece


def local_pieces(chunks: List[torch.nn.Module], arch: ModelArch, rank: int, role: str = "policy",
                 merge_adapters: bool = True) -> Tuple[List[Piece], Dict[Tuple[str, int], torch.Tensor]]:
    """This rank's pieces and their tensors, keyed (canonical, tp_rank); `rank` is its rank in
    the sync's Links. A tied output layer (the last stage's copy of the embedding) is left out:
    the embedding itself is sent. An adapted linear's weight is sent with its LoRA adapters merged
    in (lora.MergedWeight: computed as the transport reads it), unless `merge_adapters` is False
    (a destination serving the adapters from slots of its own takes the base). A rank without
    chunks (a rollout rank) holds none."""
    if not chunks:
        return [], {}
    pieces, tensors = [], {}
    merged = lora.merged_weights(chunks) if merge_adapters else {}
    for slot, param in weight_slots(chunks):
        if weight_tables.entry_of(arch, slot.canonical, role).megatron != slot.canonical:
            continue
        tensor = merged.get(id(param)) or param.detach()
        pieces.append(Piece(rank=rank, canonical=slot.canonical, tp_rank=slot.tp_rank,
                            tp_size=slot.tp_size, tp_dim=slot.tp_dim, glu=slot.glu,
                            shape=tuple(tensor.shape), dtype=str(tensor.dtype),
                            sections=slot.sections))
        tensors[(slot.canonical, slot.tp_rank)] = tensor
    return pieces, tensors


@dataclass(frozen=True)
class Gathered:
    """Every rank's pieces, known by `key`: the sync's group and each rank's digest of its own
    pieces. Equal keys, equal pieces; hashing and comparing read the key alone (a few dozen ints),
    never the pieces (69k at Qwen3-235B on 64 ranks), so later syncs find their plan cheaply."""
    key: Tuple[str, Tuple[int, ...]]
    pieces: Tuple[Piece, ...] = field(compare=False, repr=False)


_GATHERED: Dict[Tuple[str, Tuple[int, ...]], Gathered] = {}


def digest(pieces: List[Piece]) -> int:
    """A stable 63-bit digest of one rank's pieces (Python's hash() differs per process)."""
    return int.from_bytes(hashlib.blake2b(repr(pieces).encode(), digest_size=8).digest(), "big") >> 1


def gather(mine: List[Piece], links: Links) -> Gathered:
    """Every rank's pieces. The metadata itself is exchanged once per layout: each call gathers
    only one digest per rank (one small collective), and every rank sees the same digests, so
    all of them agree on whether the pieces are already known (per group: a process that joins
    a new group, e.g. a replaced rollout engine's bridge, knows nothing of it yet)."""
    if links.size == 1:
        return Gathered((links.name, (digest(mine),)), tuple(mine))
    key = (links.name, tuple(links.all_gather_object(digest(mine))))
    if key not in _GATHERED:
        _GATHERED[key] = Gathered(key, tuple(piece for rank_pieces in links.all_gather_object(mine)
                                             for piece in rank_pieces))
    return _GATHERED[key]


def all_pieces(mine: List[Piece], links: Links) -> Tuple[Piece, ...]:
    """gather's pieces, without their key."""
    return gather(mine, links).pieces


def model_bytes(pieces: Tuple[Piece, ...]) -> int:
    """Bytes of the full model: each (tensor, TP shard) once, however many replicas hold it."""
    return sum({(p.canonical, p.tp_rank): p.nbytes for p in pieces}.values())
