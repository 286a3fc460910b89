"""The resharding plan: which rank sends which slab of which piece to which destination tensor
of which rank, in which bucket.

Pure and deterministic: a function of the pieces every training rank holds (metadata.py, or
source_layout.py without any weights), of every destination rank's tensors (destination.py), of
the bucket size and of which node each rank is on. Cached per layout pair, so a run builds it
once; testable with fake metadata, no processes; the cluster planner runs the very same code.

Each destination region is cut by the TP shards that hold it, and each cut is read from one
replica of its shard (DP/CP/EP copies): the destination rank itself when it holds one (a local
copy, nothing sent), else one on the same node, else the least loaded, so each rank receives
only the bytes of its own engine shard. Buckets hold whole destination modules (the engine
finishes a module at once), in the weight-table order (layer by layer).
"""

import functools
import math
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

from megarl.models.hf_config import DTYPES
from megarl.resharding.destination import DestTensor

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

    def spans(self, dim: int) -> List[Tuple[int, int, int]]:
        """(full start, local start, length) of what this piece holds along `dim`."""
        n = self.shape[dim]
        if self.tp_dim is None:
            return [(0, 0, n)]
        if self.tp_dim != dim:
            raise ValueError(f"{self.canonical}: a destination cuts it along dim {dim}, but "
                             f"Megatron shards it along dim {self.tp_dim}")
        if self.glu:  # [gate shard; up shard] of [gate; up]
            half = n // 2
            return [(self.tp_rank * half, 0, half), (self.tp_size * half + self.tp_rank * half, half, half)]
        return [(self.tp_rank * n, 0, n)]


@dataclass(frozen=True)
class Copy:
    """Slab [src_start, src_start + length) along `dim` of piece (canonical, tp_rank) on rank `src`
    into destination tensor `tensor` (its `expert`-th slice) at `dst_start` on rank `dst`."""
    src: int
    dst: int
    canonical: str
    tp_rank: int
    dim: int
    src_start: int
    length: int
    tensor: str
    expert: Optional[int]
    dst_start: int
    numel: int
    dtype: str

    @property
    def nbytes(self) -> int:
        return self.numel * _BYTES[self.dtype]


@dataclass(frozen=True)
class Bucket:
    modules: Tuple[str, ...]
    rounds: Tuple[Tuple[Copy, ...], ...]  # exchanged one after another: each round's buffers
                                           # on any rank fit in the bucket size (or hold one copy)

    @property
    def copies(self) -> Tuple[Copy, ...]:
        return tuple(c for r in self.rounds for c in r)


def _rounds(copies: List[Copy], bucket_bytes: int) -> Tuple[Tuple[Copy, ...], ...]:
    """Split a bucket's copies so no rank sends plus receives more than `bucket_bytes` in one
    round (a single larger copy gets a round to itself on its ranks): a module larger than the
    bucket is still opened whole, but moved in bucket-sized rounds. First fit: each copy goes to
    the first round where both its ranks still have room, so a round serves many receivers at
    once instead of the next few in rank order."""
    rounds: List[List[Copy]] = [[]]
    traffic: List[Dict[int, int]] = [{}]
    first_open: Dict[int, int] = {}  # per rank: rounds before this one are full for it

    def fits(i: int, rank: int, nbytes: int) -> bool:
        used = traffic[i].get(rank, 0)
        return used == 0 or used + nbytes <= bucket_bytes

    for copy in copies:
        if copy.src == copy.dst:
            rounds[0].append(copy)
            continue
        i = max(first_open.get(copy.src, 0), first_open.get(copy.dst, 0))
        while i < len(rounds) and not (fits(i, copy.src, copy.nbytes) and fits(i, copy.dst, copy.nbytes)):
            i += 1
        if i == len(rounds):
            rounds.append([])
            traffic.append({})
        rounds[i].append(copy)
        for rank in (copy.src, copy.dst):
            traffic[i][rank] = traffic[i].get(rank, 0) + copy.nbytes
            while (first_open.get(rank, 0) < len(rounds)
                   and traffic[first_open.get(rank, 0)].get(rank, 0) >= bucket_bytes):
                first_open[rank] = first_open.get(rank, 0) + 1
    return tuple(tuple(r) for r in rounds if r)


@dataclass(frozen=True)
class Plan:
    buckets: Tuple[Bucket, ...]
    tensors: Dict[int, Tuple[DestTensor, ...]]  # every destination rank's tensors

    def received(self, rank: int) -> int:
        """Bytes `rank` receives from other ranks."""
        return sum(c.nbytes for b in self.buckets for c in b.copies if c.dst == rank != c.src)

    def sent(self, rank: int) -> int:
        return sum(c.nbytes for b in self.buckets for c in b.copies if c.src == rank != c.dst)

    def shard_bytes(self, rank: int) -> int:
        """Bytes of `rank`'s own destination tensors that come from the model (its shard)."""
        return sum(c.nbytes for b in self.buckets for c in b.copies if c.dst == rank)


def _owner(replicas: List[Piece], dst: int, node_of: Tuple[int, ...], load: Dict[int, int]) -> Piece:
    def cost(piece: Piece):
        return (piece.rank != dst, node_of[piece.rank] != node_of[dst], load.get(piece.rank, 0),
                piece.rank)
    return min(replicas, key=cost)


def _cut(region, held: Dict[int, List[Piece]], tensor: DestTensor, dst: int,
         node_of: Tuple[int, ...], load: Dict[int, int]) -> List[Copy]:
    """The copies that fill one region, one per intersecting TP shard."""
    copies, covered = [], 0
    for _, replicas in sorted(held.items()):
        piece = _owner(replicas, dst, node_of, load)
        for full, local, n in piece.spans(region.dim):
            lo, hi = max(full, region.start), min(full + n, region.start + region.length)
            if lo >= hi:
                continue
            numel = (hi - lo) * piece.numel // piece.shape[region.dim]
            copies.append(Copy(piece.rank, dst, region.canonical, piece.tp_rank, region.dim,
                               local + lo - full, hi - lo, tensor.name, region.expert,
                               region.dst_start + lo - region.start, numel, piece.dtype))
            covered += hi - lo
            if piece.rank != dst:
                load[piece.rank] = load.get(piece.rank, 0) + copies[-1].nbytes
    if covered != region.length:
        raise ValueError(f"{region.canonical}: the training ranks hold {covered} of the "
                         f"{region.length} rows {tensor.name} on rank {dst} needs along dim {region.dim}")
    return copies


@functools.lru_cache(maxsize=16)
def build_plan(pieces: Tuple[Piece, ...], layout: Tuple[Tuple[int, Tuple[DestTensor, ...]], ...],
               bucket_bytes: int, node_of: Optional[Tuple[int, ...]] = None) -> Plan:
    """`layout`: (rank, its destination tensors) for every receiving rank; `node_of[rank]`: the
    node of each rank (default: one node). A bucket closes before the module that would make a
    rank's materialized-plus-sent bytes exceed `bucket_bytes`; a larger module gets its own."""
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    by_tensor: Dict[str, Dict[int, List[Piece]]] = {}
    for piece in pieces:  # a tensor replicated over TP is one shard, held by every TP rank
        shard = piece.tp_rank if piece.tp_dim is not None else 0
        by_tensor.setdefault(piece.canonical, {}).setdefault(shard, []).append(piece)
    for canonical, shards in by_tensor.items():
        first = next(iter(shards.values()))[0]
        tp_size = first.tp_size if first.tp_dim is not None else 1
        if sorted(shards) != list(range(tp_size)):
            raise ValueError(f"{canonical}: TP shards {sorted(shards)} of {tp_size} are held")
    world = 1 + max([p.rank for p in pieces] + [rank for rank, _ in layout])
    node_of = node_of or (0,) * world
    needed = {r.canonical for _, tensors in layout for t in tensors for r in t.regions}
    missing, unexpected = sorted(needed - set(by_tensor)), sorted(set(by_tensor) - needed)
    if missing or unexpected:
        raise ValueError(f"source model and destination disagree: missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]}")

    modules: Dict[str, Dict[int, List[DestTensor]]] = {}  # module -> rank -> its tensors
    for rank, tensors in layout:
        for tensor in tensors:
            modules.setdefault(tensor.module, {}).setdefault(rank, []).append(tensor)
    load: Dict[int, int] = {}
    buckets, names, copies, cost = [], [], [], {}
    for module, per_rank in modules.items():
        mine, mine_cost = [], {}
        for rank, tensors in per_rank.items():
            for tensor in tensors:
                itemsize = None
                for region in tensor.regions:
                    cut = _cut(region, by_tensor[region.canonical], tensor, rank, node_of, load)
                    mine += cut
                    itemsize = itemsize or (cut[0].nbytes // cut[0].numel if cut else None)
                    for c in cut:
                        if c.src != c.dst:
                            mine_cost[c.src] = mine_cost.get(c.src, 0) + c.nbytes
                mine_cost[rank] = mine_cost.get(rank, 0) + tensor.numel * (itemsize or 0)
        if names and any(cost.get(r, 0) + b > bucket_bytes for r, b in mine_cost.items()):
            buckets.append(Bucket(tuple(names), _rounds(copies, bucket_bytes)))
            names, copies, cost = [], [], {}
        names.append(module)
        copies += mine
        for r, b in mine_cost.items():
            cost[r] = cost.get(r, 0) + b
    if names:
        buckets.append(Bucket(tuple(names), _rounds(copies, bucket_bytes)))
    return Plan(tuple(buckets), dict(layout))
