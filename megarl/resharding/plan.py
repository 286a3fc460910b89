"""The resharding plan: which rank sends which piece of which full tensor, in which bucket.

Pure and deterministic: a function of the pieces every rank holds and of the bucket size, so it
is computed once per layout pair (lru_cache) and testable with fake metadata, no processes.
"""

import functools
import math
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

_BYTES = {"torch.float32": 4, "torch.bfloat16": 2, "torch.float16": 2}


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
        return sorted({p.rank for t in self.tensors for p in t.pieces})


@functools.lru_cache(maxsize=16)
def build_plan(pieces: Tuple[Piece, ...], expected: Tuple[str, ...],
               bucket_bytes: int) -> Tuple[Bucket, ...]:
    """Choose one owner per (tensor, TP shard) -- the lowest rank among its DP/CP/EP replicas --
    and pack the tensors, in `expected` order, into buckets of at most `bucket_bytes` (a larger
    tensor gets a bucket of its own). Raises if a tensor is missing, incomplete or unexpected."""
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
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
            tensors.append(TensorPlan(canonical, (min(shards.values(), key=lambda p: p.rank),)))
            continue
        if sorted(shards) != list(range(first.tp_size)):
            raise ValueError(f"{canonical}: TP shards {sorted(shards)} of {first.tp_size} are held")
        tensors.append(TensorPlan(canonical, tuple(shards[r] for r in range(first.tp_size))))
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
