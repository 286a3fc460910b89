"""The resharding plan: which rank sends which slab of which piece to which destination tensor
of which rank, in which bucket.

Pure and deterministic: a function of the pieces every training rank holds (metadata.py, or
source_layout.py without any weights), of every destination rank's tensors (models/weights/destination.py), of
the bucket size and of which node each rank is on. Built once per layout and weights' shapes
(sync.rank_plan keeps each rank's share; this module caches nothing: its inputs are millions of
objects, too many to hash on every sync); testable with fake metadata, no processes; the cluster
planner runs the very same code.

Each destination region is cut by the TP shards that hold it, and each cut is read from one
replica of its shard (DP/CP/EP copies): the destination rank itself when it holds one (a local
copy, nothing sent), else one on the same node, else the least loaded, so each rank receives
only the bytes of its own engine shard. Buckets hold whole destination modules (the engine
finishes a module at once), layer by layer in weight-table order within each pipeline stage;
each independent engine takes the stages in turn from its own starting stage, so in every bucket
every stage sends, each to its share of the engines. Each rank's own share of every round is
indexed once with the plan, so a sync never walks other ranks' copies.

Into a block-FP8 engine tensor (DestTensor.fp8) the copies are of one of two kinds, chosen here
per destination tensor on each rank: when every copy into it is whole 128 x 128 blocks
(fp8_layout.sender_quantizes), each is `Copy.fp8`: its sender quantizes it and sends codes and
scales, and the engine rank writes them straight into its codes and scales; otherwise every copy
carries the model's dtype and the engine rank quantizes the whole tensor once it holds it.
"""

import collections
import dataclasses
import math
from dataclasses import dataclass, field
from typing import Dict, FrozenSet, List, Optional, Sequence, Tuple

from megarl.models.hf.config import DTYPES
from megarl.models.weights import fp8_layout
from megarl.models.weights.destination import DestTensor

_BYTES = {str(dtype): dtype.itemsize for dtype in DTYPES.values()}  # keyed like Piece.dtype
DIRECT_BYTES = 256 * 2**10
FP8_WIRE = "torch.uint8"  # sender-quantized copies travel as bytes: their scales, then their codes


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
    sections: Tuple[int, ...] = ()  # full sizes of parts sharded apart (param_layout.ParamSlot)

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
        if self.sections:  # [part 0 shard; part 1 shard; ...] of [part 0; part 1; ...]
            spans, full, local = [], 0, 0
            for size in self.sections:
                n = size // self.tp_size
                spans.append((full + self.tp_rank * n, local, n))
                full, local = full + size, local + n
            return spans
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
    dst_step: int = 1  # destination rows this far apart (Region.step)
    fp8: bool = False  # quantized by the sender: block-FP8 codes and scales travel (module docstring)

    @property
    def nbytes(self) -> int:
        if self.fp8:
            return fp8_layout.sent_bytes(self.numel, self.dim, self.length)
        return self.numel * _BYTES[self.dtype]

    @property
    def wire(self) -> str:
        """The dtype of the message it travels in (packed copies: one message per peer, round
        and wire)."""
        return FP8_WIRE if self.fp8 else self.dtype

    @property
    def direct(self) -> bool:
        """Sent as its own message, straight from the source tensor into the target, with no
        buffer on either side: a large slab of rows, contiguous on both ends (parameters are
        contiguous; a slab along dim 0 of one, or of one expert of one, is too). Smaller or
        column slabs share one packed buffer per peer and round, so per-message costs stay
        bounded. Both ends, and the cluster planner, decide from the plan alone. A sender-quantized
        copy is made on the sender anyway (its codes and scales): it is packed."""
        return (self.src != self.dst and self.dim == 0 and self.dst_step == 1 and not self.fp8
                and self.nbytes >= DIRECT_BYTES)


@dataclass(frozen=True)
class Bucket:
    modules: Dict[int, Tuple[str, ...]]  # each receiving rank's modules, opened and finished here
    rounds: Tuple[Tuple[Copy, ...], ...]  # exchanged one after another: each round's buffers
                                           # on any rank fit in the bucket size (or hold one copy)

    @property
    def copies(self) -> Tuple[Copy, ...]:
        return tuple(c for r in self.rounds for c in r)


def peak_bound(tensors: Sequence[DestTensor], bucket_bytes: int, itemsize: int) -> int:
    """Pure: the most extra memory a sync planned by build_plan allocates at once on a rank that
    receives `tensors` (its destination tensors): a bucket's opened tensors, at most bucket_bytes
    or one larger module (_engine_buckets), plus one round's buffers, at most bucket_bytes or one
    larger copy (_rounds), and no copy is larger than a module. The memory planner's sync and
    export term (planning/memory_plan.py); planning the copies themselves takes minutes at 671B."""
    modules: Dict[str, int] = {}
    for t in tensors:
        modules[t.module] = modules.get(t.module, 0) + t.engine_bytes(itemsize)
    return 2 * max(bucket_bytes, max(modules.values(), default=0))


def opened_bytes(tensor: DestTensor, itemsize: int, quantized: FrozenSet[str]) -> int:
    """What a rank opens for its destination `tensor` (sync._stream counts it): its codes and
    scales when its senders quantize it (`quantized`: Plan.quantized), else the tensor in the
    model's dtype (`itemsize`; an FP8 engine quantizes from it at close) or in fp32 where the
    engine holds it so (DestTensor.fp32)."""
    if tensor.name in quantized:
        return tensor.numel + fp8_layout.scale_count(tensor.shape) * fp8_layout.SCALE_BYTES
    return tensor.engine_bytes(itemsize)


def _rounds(copies: List[Copy], bucket_bytes: int) -> Tuple[Tuple[Copy, ...], ...]:
    """Split a bucket's copies so no rank's buffers of one round (what it packs to send plus what
    it receives packed) exceed `bucket_bytes`; a single larger copy gets a round to itself on its
    ranks. Local and direct copies need no buffer: they all go in the first round, so a rank's
    large sends and receives overlap instead of falling into different rounds. First fit: each
    packed copy goes to the first round where both its ranks still have room, so a round serves
    many receivers at once instead of the next few in rank order."""
    rounds: List[List[Copy]] = [[]]
    buffers: List[Dict[int, int]] = [{}]
    first_open: Dict[int, int] = {}  # per rank: rounds before this one are full for it

    def fits(i: int, rank: int, nbytes: int) -> bool:
        used = buffers[i].get(rank, 0)
        return used == 0 or used + nbytes <= bucket_bytes

    for copy in copies:
        if copy.src == copy.dst or copy.direct:
            rounds[0].append(copy)
            continue
        i = max(first_open.get(copy.src, 0), first_open.get(copy.dst, 0))
        while i < len(rounds) and not (fits(i, copy.src, copy.nbytes) and fits(i, copy.dst, copy.nbytes)):
            i += 1
        if i == len(rounds):
            rounds.append([])
            buffers.append({})
        rounds[i].append(copy)
        for rank in (copy.src, copy.dst):
            buffers[i][rank] = buffers[i].get(rank, 0) + copy.nbytes
            while (first_open.get(rank, 0) < len(rounds)
                   and buffers[first_open.get(rank, 0)].get(rank, 0) >= bucket_bytes):
                first_open[rank] = first_open.get(rank, 0) + 1
    return tuple(tuple(r) for r in rounds if r)


Work = Tuple[Tuple[Tuple[Copy, ...], ...], ...]  # one rank's copies: per bucket, per round


@dataclass(frozen=True)
class Plan:
    buckets: Tuple[Bucket, ...]
    tensors: Dict[int, Tuple[DestTensor, ...]]  # every destination rank's tensors
    # each rank's own copies (as source or destination), bucket by bucket: indexed once
    work: Dict[int, Work] = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        object.__setattr__(self, "work", _index(self.buckets))

    def rank_work(self, rank: int) -> Work:
        return self.work.get(rank, ((),) * len(self.buckets))

    def _own(self, rank: int):
        return (c for rounds in self.rank_work(rank) for copies in rounds for c in copies)

    def received(self, rank: int) -> int:
        """Bytes `rank` receives from other ranks."""
        return sum(c.nbytes for c in self._own(rank) if c.dst == rank != c.src)

    def sent(self, rank: int) -> int:
        return sum(c.nbytes for c in self._own(rank) if c.src == rank != c.dst)

    def shard_bytes(self, rank: int) -> int:
        """Bytes of `rank`'s own destination tensors that come from the model (its shard)."""
        return sum(c.nbytes for c in self._own(rank) if c.dst == rank)

    def quantized(self, rank: int) -> FrozenSet[str]:
        """`rank`'s FP8 destination tensors its senders quantize (Copy.fp8): it opens their codes
        and scales, not a tensor in the model's dtype."""
        if not any(t.fp8 for t in self.tensors.get(rank, ())):  # no walk over its copies
            return frozenset()
        return frozenset(c.tensor for c in self._own(rank) if c.dst == rank and c.fp8)


def _index(buckets: Tuple[Bucket, ...]) -> Dict[int, Work]:
    """Each rank's share of every round, in plan order: what transport.exchange runs on it."""
    work: Dict[int, List[List[List[Copy]]]] = {}
    for b, bucket in enumerate(buckets):
        for r, copies in enumerate(bucket.rounds):
            for copy in copies:
                for rank in {copy.src, copy.dst}:
                    mine = work.get(rank)
                    if mine is None:
                        mine = work[rank] = [[] for _ in buckets]
                    if len(mine[b]) <= r:
                        mine[b] += [[] for _ in range(r + 1 - len(mine[b]))]
                    mine[b][r].append(copy)
    return {rank: tuple(tuple(tuple(c) for c in rounds if c) for rounds in mine)
            for rank, mine in work.items()}


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
                               region.dst_start + (lo - region.start) * region.step, numel, piece.dtype,
                               region.step))
            covered += hi - lo
            if piece.rank != dst:
                load[piece.rank] = load.get(piece.rank, 0) + copies[-1].nbytes
    if covered != region.length:
        raise ValueError(f"{region.canonical}: the training ranks hold {covered} of the "
                         f"{region.length} rows {tensor.name} on rank {dst} needs along dim {region.dim}")
    return copies


def _stage_queues(layout: Tuple[Tuple[int, Tuple[DestTensor, ...]], ...],
                  by_tensor: Dict[str, Dict[int, List[Piece]]]) -> List[List[str]]:
    """The destination modules in weight-table order, grouped by the set of training ranks that
    hold them (with PP: one queue per pipeline stage)."""
    canonicals: Dict[str, set] = {}  # module -> the full tensors it is made of, on any rank
    for _, tensors in layout:
        for t in tensors:
            canonicals.setdefault(t.module, set()).update(r.canonical for r in t.regions)
    groups: Dict[frozenset, List[str]] = {}
    for module, names in canonicals.items():
        holders = frozenset(p.rank for c in names for replicas in by_tensor[c].values() for p in replicas)
        groups.setdefault(holders, []).append(module)
    return list(groups.values())


def _engine_buckets(queues: List[List[str]], size: Dict[str, int], engine: int, engines: int,
                    bucket_bytes: int) -> List[List[str]]:
    """One engine's buckets of modules. The stage queues are taken in turn, a chunk of whole
    modules from each (at least one, else up to a bucket's share of the engine's largest rank),
    starting at a stage that depends on the engine, spread evenly over the stages; a bucket is
    one chunk when there are at least as many engines as stages, else ceil(stages / engines)
    chunks. An exhausted stage leaves its chunk empty instead of letting the later ones move up.
    So in bucket b the engines read different stages: every stage sends in every bucket, each to
    its share of the engines. With one order for all engines, a bucket's one or two stages sent
    to every engine while the others idled (DeepSeek-V3 at PP16 into 16 engines was planned at
    6.9 s instead of 0.97 s: docs/PERFORMANCE.md)."""
    per = -(-len(queues) // engines)  # stages a bucket spans
    start = engine * len(queues) // engines
    turned = [collections.deque(q) for q in queues[start:] + queues[:start]]
    chunks: List[List[str]] = []
    while any(turned):
        for queue in turned:
            chunk, taken = [], 0
            while queue and (not chunk or taken + size[queue[0]] <= bucket_bytes / per):
                taken += size[queue[0]]
                chunk.append(queue.popleft())
            chunks.append(chunk)
    buckets: List[List[str]] = []
    for i in range(0, len(chunks), per):  # `per` chunks, unless modules larger than their share
        buckets.append([])                # make them exceed the bucket: then one bucket each
        total = 0
        for chunk in chunks[i:i + per]:
            nbytes = sum(size[m] for m in chunk)
            if buckets[-1] and total + nbytes > bucket_bytes:
                buckets.append([])
                total = 0
            buckets[-1] += chunk
            total += nbytes
    return buckets


def _itemsize(tensor: DestTensor, by_tensor: Dict[str, Dict[int, List[Piece]]]) -> int:
    """Bytes per element of a destination tensor: its sources' (the engine takes the model's); a
    tensor no region writes (gpt-oss's expert down bias on TP ranks past the first) the model's."""
    canonical = tensor.regions[0].canonical if tensor.regions else next(iter(by_tensor))
    return _BYTES[next(iter(by_tensor[canonical].values()))[0].dtype]


def _engine_of(engines: Tuple[Tuple[int, ...], ...], receiving: List[int]) -> Dict[int, int]:
    engine_of: Dict[int, int] = {}
    for e, ranks in enumerate(engines):
        for rank in ranks:
            if rank in engine_of:
                raise ValueError(f"rank {rank} is in engines {engine_of[rank]} and {e}")
            engine_of[rank] = e
    outside = [rank for rank in receiving if rank not in engine_of]
    if outside:
        raise ValueError(f"receiving ranks {outside[:5]} are in none of the {len(engines)} engines")
    return engine_of


def build_plan(pieces: Tuple[Piece, ...], layout: Tuple[Tuple[int, Tuple[DestTensor, ...]], ...],
               bucket_bytes: int, node_of: Optional[Tuple[int, ...]] = None,
               engines: Optional[Tuple[Tuple[int, ...], ...]] = None) -> Plan:
    """`layout`: (rank, its destination tensors) for every receiving rank; `node_of[rank]`: the
    node of each rank (default: one node); `engines`: every independent engine's ranks (default:
    all receiving ranks one engine; an engine may have no rank in `layout`: the cluster planner
    plans some engines only, each still in its own place). Each engine has buckets of its own
    (_engine_buckets: at most `bucket_bytes` of opened engine tensors on any of its ranks, or one
    larger module); the plan's bucket b holds every engine's b-th, exchanged together, its
    buffers bounded apart, per round (_rounds)."""
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
    engines = engines or (tuple(rank for rank, _ in layout),)
    engine_of = _engine_of(engines, [rank for rank, _ in layout])

    queues = _stage_queues(layout, by_tensor)
    per_engine: Dict[int, Dict[str, Dict[int, List[DestTensor]]]] = {}  # engine -> module -> rank
    ranks_of: Dict[int, List[int]] = {}
    for rank, tensors in layout:
        ranks_of.setdefault(engine_of[rank], []).append(rank)
        for tensor in tensors:
            per_engine.setdefault(engine_of[rank], {}).setdefault(tensor.module, {}).setdefault(
                rank, []).append(tensor)
    planned: Dict[int, List[List[str]]] = {}
    for e, mine in per_engine.items():
        size = {module: max(sum(t.numel * _itemsize(t, by_tensor) for t in tensors)
                            for tensors in per_rank.values()) for module, per_rank in mine.items()}
        planned[e] = _engine_buckets([[m for m in q if m in mine] for q in queues], size, e, len(engines),
                                     bucket_bytes)
    load: Dict[int, int] = {}
    buckets = []
    for b in range(max(map(len, planned.values()), default=0)):  # engines in step: `load` stays even
        opened: Dict[int, Tuple[str, ...]] = {}
        copies: List[Copy] = []
        for e, names in ((e, mine[b]) for e, mine in planned.items() if b < len(mine) and mine[b]):
            opened.update((rank, tuple(names)) for rank in ranks_of[e])
            for module in names:
                copies += _module_copies(per_engine[e][module], by_tensor, node_of, load)
        if copies or opened:
            buckets.append(Bucket(opened, _rounds(copies, bucket_bytes)))
    return Plan(tuple(buckets), dict(layout))


def _module_copies(per_rank: Dict[int, List[DestTensor]], by_tensor: Dict[str, Dict[int, List[Piece]]],
                   node_of: Tuple[int, ...], load: Dict[int, int]) -> List[Copy]:
    """One module's copies on its ranks."""
    copies: List[Copy] = []
    for rank, tensors in per_rank.items():
        for tensor in tensors:
            cut = [copy for region in tensor.regions
                   for copy in _cut(region, by_tensor[region.canonical], tensor, rank, node_of, load)]
            copies += _sender_quantized(tensor, cut, load) if tensor.fp8 else cut
    return copies


def _sender_quantized(tensor: DestTensor, copies: List[Copy], load: Dict[int, int]) -> List[Copy]:
    """The copies into FP8 `tensor` on one rank, each made Copy.fp8 when every one is whole blocks
    (fp8_layout.sender_quantizes) of a source in the engine's dtype; their senders' load then counts
    the bytes they send."""
    if not all(c.dst_step == 1 and c.dtype in fp8_layout.SENDER_DTYPES
               and fp8_layout.sender_quantizes(tensor, c.dim, c.dst_start, c.length) for c in copies):
        return copies
    quantized = [dataclasses.replace(c, fp8=True) for c in copies]
    for before, after in zip(copies, quantized):
        if before.src != before.dst:
            load[before.src] += after.nbytes - before.nbytes
    return quantized
