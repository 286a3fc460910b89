"""The resharding plan: which rank sends which piece of which full tensor, in which bucket.

Pure and deterministic: a function of the pieces every rank holds, of the bucket size and of the
rollout TP size, so it is computed once per layout pair (lru_cache) and testable with fake
metadata, no processes. A tensor is "local" when every rank already holds what its rollout engine
rank loads of it (the full tensor, or the Megatron TP shard with the engine's TP size and index,
as in a colocated same-TP layout): it is not sent at all.
"""

import functools
import math
from dataclasses import dataclass
from typing import Dict, FrozenSet, Iterable, List, Optional, Tuple

from megarl.models.hf_config import DTYPES

_BYTES = {str(dtype): dtype.itemsize for dtype in DTYPES.values()}  # keyed like Piece.dtype


@dataclass(frozen=True)
class Piece:
    """One local tensor on one rank: TP shard `tp_rank` of full tensor `canonical`."""
    rank: int
    canonical: str
    tp_rank: int
    tp_size: int
    tp_dim: Optional[int]
    glu: bool
    shape: Tuple[int, ...]
    dtype: str

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * _BYTES[self.dtype]


@dataclass(frozen=True)
class TensorPlan:
    canonical: str
    pieces: Tuple[Piece, ...]  # one per TP rank, in TP-rank order; each from its chosen owner
    local: bool = False        # every rank holds its engine_piece: the pieces are not sent

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.pieces)


@dataclass(frozen=True)
class Bucket:
    tensors: Tuple[TensorPlan, ...]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    def owners(self) -> List[int]:
        """Ranks that send in this bucket."""
        return sorted({p.rank for t in self.tensors if not t.local for p in t.pieces})


def engine_piece(held: Iterable[Piece], rank: int, rollout_tp: int) -> Optional[Piece]:
    """Among one rank's pieces of one tensor, one its rollout engine rank can load without the
    other ranks: the full tensor, or the TP shard the engine's own loaders would cut. Engine TP
    ranks are consecutive global ranks (rank % rollout_tp), as are Megatron's TP ranks."""
    for piece in held:
        if piece.tp_dim is None or (piece.tp_size == rollout_tp
                                    and piece.tp_rank == rank % rollout_tp):
            return piece
    return None


@functools.lru_cache(maxsize=16)
def build_plan(pieces: Tuple[Piece, ...], expected: Tuple[str, ...], bucket_bytes: int,
               rollout_tp: Optional[int] = None,
               whole_only: FrozenSet[str] = frozenset()) -> Tuple[Bucket, ...]:
    """Choose one owner per (tensor, TP shard) -- the lowest rank among its DP/CP/EP replicas --
    and pack the tensors, in `expected` order, into buckets of at most `bucket_bytes` (a larger
    tensor gets a bucket of its own). Raises if a tensor is missing, incomplete or unexpected.
    With `rollout_tp` (the engine loads full-shaped tensors holding only its own TP slice), mark
    the tensors every rank holds an engine_piece of as local; `whole_only` tensors are never
    local unless held whole (e.g. a padded vocabulary, whose shards are not the engine's)."""
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    held: Dict[Tuple[int, str], List[Piece]] = {}
    for piece in pieces:
        held.setdefault((piece.rank, piece.canonical), []).append(piece)
    ranks = sorted({p.rank for p in pieces})

    def local(canonical: str) -> bool:
        if rollout_tp is None:
            return False
        for rank in ranks:
            piece = engine_piece(held.get((rank, canonical), ()), rank, rollout_tp)
            if piece is None or (piece.tp_dim is not None and canonical in whole_only):
                return False
        return True

    owner: Dict[Tuple[str, int], Piece] = {}
    for piece in sorted(pieces, key=lambda p: p.rank):
        owner.setdefault((piece.canonical, piece.tp_rank), piece)
    by_tensor: Dict[str, Dict[int, Piece]] = {}
    for (canonical, tp_rank), piece in owner.items():
        by_tensor.setdefault(canonical, {})[tp_rank] = piece
    unexpected = sorted(set(by_tensor) - set(expected))
    missing = sorted(set(expected) - set(by_tensor))
    if unexpected or missing:
        raise ValueError(f"source model and weight table disagree: missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]}")
    tensors = []
    for canonical in expected:
        shards = by_tensor[canonical]
        first = shards[min(shards)]
        if first.tp_dim is None:  # replicated over TP: any one copy is the full tensor
            tensors.append(TensorPlan(canonical, (min(shards.values(), key=lambda p: p.rank),),
                                      local(canonical)))
            continue
        if sorted(shards) != list(range(first.tp_size)):
            raise ValueError(f"{canonical}: TP shards {sorted(shards)} of {first.tp_size} are held")
        tensors.append(TensorPlan(canonical, tuple(shards[r] for r in range(first.tp_size)),
                                  local(canonical)))
    buckets, current, current_bytes = [], [], 0
    for tensor in tensors:
        if current and current_bytes + tensor.nbytes > bucket_bytes:
            buckets.append(Bucket(tuple(current)))
            current, current_bytes = [], 0
        current.append(tensor)
        current_bytes += tensor.nbytes
    if current:
        buckets.append(Bucket(tuple(current)))
    return tuple(buckets)
