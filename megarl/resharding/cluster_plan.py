"""The weight sync of a cluster layout, planned without weights, and what it would cost.

scripts/plan_sync.py is its command line. The plan is the very one sync_weights executes: the
training ranks' pieces from source_layout.layout_pieces, each vLLM rank's tensors from
destination.vllm_layout, cut by plan.build_plan with each rank's node. `plan_stats` reads, in one
pass over the plan, what each rank receives and sends within its node and across nodes, the
messages transport.py posts for it (the same rule: Copy.direct), and its planned peak
memory (as sync.py counts it: a bucket's opened engine tensors + its largest round's buffers),
and turns that into seconds at stated link speeds (every constant is a field of `Links`, the
measured ones per GPU kind from gpu_kinds.KINDS; the model is written out in
scripts/plan_sync.py's docstring).

Large layouts: each engine adds its own copies (a rollout TP8 rank of a 128-expert model holds
every expert of every layer: ~36k copies per rank for Qwen3-235B). When the estimate exceeds
`max_regions`, only one engine of each distinct placement is planned (`planned_engines`): an
engine's rank at engine position p receives from its own rank, its node, or another node, and
which pieces sit where is a function of the training coordinates of its ranks and of their
nodes' ranks, so engines with the same such signature receive exactly the same bytes, intra-
and inter-node (tests/test_plan_sync_unit.py checks it against full plans). What ranks send, and
so the seconds, then count the planned engines only (lower bounds, `ClusterPlan.note`).
"""

import time
from dataclasses import asdict, dataclass, field
from typing import Dict, FrozenSet, List, Optional, Tuple

from megarl.models.hf.config import DTYPES, ModelArch, arch_from_hf_config
from megarl.models.weights import engine_fp32, fp8_layout
from megarl.models.weights.destination import RolloutLayout, check_rollout, vllm_layout
from megarl.parallel_state.dims import ParallelDims
from megarl.resharding import gpu_kinds, metadata
from megarl.resharding.plan import Plan, build_plan, opened_bytes
from megarl.resharding.source_layout import layout_pieces, rank_coords

TRAIN_KEYS = ("tp", "pp", "cp", "ep", "etp", "vpp", "dp", "first_stage_layers", "last_stage_layers")
ROLLOUT_KEYS = ("tp", "ep")
# Above this many destination regions (each is at least one Copy; ~8 us of planning each), plan
# one engine per distinct placement instead of every engine (module docstring).
MAX_REGIONS = 3_000_000


def parse_spec(text: str, allowed: Tuple[str, ...], flag: str) -> Dict[str, int]:
    """'tp=4,pp=8,ep=16' -> {'tp': 4, 'pp': 8, 'ep': 16}; unknown keys, repeats and values that
    are not positive integers raise ValueError naming the flag."""
    out: Dict[str, int] = {}
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep:
            raise ValueError(f"{flag} {text!r}: {item!r} is not key=value (e.g. {flag} tp=4,pp=2)")
        if key not in allowed:
            raise ValueError(f"{flag} {text!r}: unknown key {key!r}; expected one of {', '.join(allowed)}")
        if key in out:
            raise ValueError(f"{flag} {text!r}: {key} given twice")
        try:
            number = int(value)
        except ValueError:
            number = 0
        if number < 1 or str(number) != value.strip():
            raise ValueError(f"{flag} {text!r}: {key}={value!r} must be a positive integer")
        out[key] = number
    return out


def train_dims(text: str, world: int) -> ParallelDims:
    """The training layout from --train; dp is derived (and checked when given)."""
    spec = parse_spec(text, TRAIN_KEYS, "--train")
    dp = spec.pop("dp", None)
    dims = ParallelDims(world_size=world, **spec)
    if dp is not None and dp != dims.dp:
        raise ValueError(f"--train {text!r}: dp={dp}, but world {world} / (tp {dims.tp} x pp {dims.pp} "
                         f"x cp {dims.cp}) = {dims.dp}; leave dp out, it is derived")
    return dims


def rollout_layout(text: str) -> RolloutLayout:
    return RolloutLayout(**parse_spec(text, ROLLOUT_KEYS, "--rollout"))


def arch_of(config: dict, dtype: Optional[str] = None) -> ModelArch:
    """ModelArch from an HF config.json dict; `dtype` ('bfloat16', ...) overrides its dtype (the
    training parameters' and the engine's: sync_weights runs both in the model's dtype)."""
    arch = arch_from_hf_config(config)
    if dtype is not None:
        if dtype not in DTYPES:
            raise ValueError(f"--dtype {dtype!r}: use one of {', '.join(sorted(DTYPES))}")
        arch = ModelArch(**{**arch.to_dict(), "dtype": dtype})
    return arch


MEASURED = ("copy_us", "pack_gbps", "hbm_gbps")  # the constants measured per GPU kind (gpu_kinds)


@dataclass(frozen=True)
class Links:
    """The cost model's constants. GB/s are 1e9 bytes per second, per GPU, per direction.
    Measured per GPU kind (gpu_kinds.KINDS, `Links.of`): copy_us, hbm_gbps and pack_gbps are what
    `python bench/bench_sync_copies.py --device cuda --experts 128 --hidden 2048 --width 768` (a
    Qwen3-30B-A3B TP8 rank's expert slabs, 393 KB; each timing ending with a synchronize) measured
    against megarl's transport on that kind; the field defaults are gpu_kinds.DEFAULT's (H100):
    - copy_us (H100 7.3, H200 11.7): the time per Copy a rank handles, host work and its share of
      the kernels. transport.py builds each Copy's source and target views and writes a round's
      copies with one torch._foreach_copy_ (`batched_us_per_copy`). On the H100 also at 3.67 MB
      slabs (`--experts 64 --hidden 7168 --width 2048`): 10.0 us. Charged copy_us + bytes /
      hbm_gbps, that is 7.57 us and 9.78 us (+4%, -2% of the H100's measurements; the earlier
      5 us + bytes / 1500 GB/s charged 5.26 us and 7.45 us, 1.38x and 1.34x too little).
    - hbm_gbps (H100 1482, H200 2086): a plain warm 1 GiB bf16 copy_ (`plain_copy_GBps`). It
      charges the bytes of local copies and of unpacking: the transport writes received slabs out
      of their buffer with the same batched torch._foreach_copy_ it writes local copies with, which
      copy_us measured.
    - pack_gbps (H100 222, H200 95): packing a send buffer, the transport's torch.cat of the same
      393 KB slabs (`pack_GBps`; on the H100 6.7x slower than a plain copy: 1.8 us a slab where the
      bytes alone take 0.27 us, the rest per-slab host work, its inputs' views, not measured
      apart). copy_us, which every Copy a rank sends also pays, charges views too: a conservative
      charge for packed sends.
    One launch per slab (narrow + copy_ of a 1.5 MB expert slab on that H100, launch-bound,
    23.7-25.8 us) is what the transport did before it batched: copy_us 25. On this project's
    2-core CPU machine a batched Copy of 24 KB slabs costs 6.3-6.7 us, 4.5 us of it the views.
    Assumed for every kind: the link speeds (nominal), message_us, round_us. `gpu` names the kind
    whose measurements the three measured fields default to (`departures` lists those set apart)."""
    nvlink_gbps: float = 450.0   # H100/H200 SXM NVLink 4: 900 GB/s bidirectional / 2
    ib_gbps: float = 50.0        # one 400 Gb/s InfiniBand NIC per GPU (DGX H100: 8 x CX-7)
    hbm_gbps: float = gpu_kinds.KINDS[gpu_kinds.DEFAULT].hbm_gbps    # device-memory copy (local
                                 # copies, unpacking), bytes per second
    pack_gbps: float = gpu_kinds.KINDS[gpu_kinds.DEFAULT].pack_gbps  # packing a send buffer
                                 # (torch.cat of its slabs), bytes per second
    message_us: float = 10.0     # per P2P message sent or received (NCCL send/recv)
    copy_us: float = gpu_kinds.KINDS[gpu_kinds.DEFAULT].copy_us      # per Copy a rank handles
                                 # (source or destination): views + its share of the round's
                                 # batched copy
    round_us: float = 100.0      # per round (batch_isend_irecv + wait, buffers, engine open/close)
    gpu: str = gpu_kinds.DEFAULT  # the kind the measured constants are of (gpu_kinds.KINDS)

    def __post_init__(self):
        if self.gpu not in gpu_kinds.KINDS:
            raise ValueError(f"gpu {self.gpu!r}: expected one of {', '.join(gpu_kinds.KINDS)}")
        for name, value in asdict(self).items():
            if name == "gpu":
                continue
            if not value >= 0 or (name.endswith("gbps") and not value > 0):
                raise ValueError(f"{name} must be {'positive' if name.endswith('gbps') else '>= 0'}, "
                                 f"got {value}")

    @classmethod
    def of(cls, kind: gpu_kinds.GpuKind, **overrides) -> "Links":
        """`kind`'s measured constants, the assumed ones at their defaults; `overrides` set any."""
        measured = dict(copy_us=kind.copy_us, pack_gbps=kind.pack_gbps, hbm_gbps=kind.hbm_gbps)
        return cls(**{**measured, **overrides, "gpu": kind.name})

    def departures(self) -> List[str]:
        """The measured constants set to other values than their kind's."""
        kind = gpu_kinds.KINDS[self.gpu]
        return [name for name in MEASURED if getattr(self, name) != getattr(kind, name)]

DEFAULT_LINKS = Links()


@dataclass
class RankStats:
    """One rank's side of the sync. `*_intra`: with other ranks of its node; `*_inter`: other nodes;
    `local_bytes`: copies whose source is the rank itself (no message)."""
    rank: int
    recv_intra: int = 0
    recv_inter: int = 0
    sent_intra: int = 0
    sent_inter: int = 0
    local_bytes: int = 0
    packed_sent: int = 0      # bytes packed into message buffers (device copies)
    packed_received: int = 0  # bytes unpacked from them
    messages: int = 0         # P2P messages it sends (SyncReport.messages)
    messages_received: int = 0
    copies_pre: int = 0       # Copies it writes locally or sends
    copies_post: int = 0      # Copies it receives from other ranks
    peak_bytes: int = 0       # planned peak extra memory (SyncReport.peak_extra_bytes)
    seconds: float = 0.0      # its own rounds back to back (Timing.seconds_rank_bound)
    terms: Dict[str, float] = field(default_factory=dict)  # those seconds by phase

    @property
    def received(self) -> int:
        return self.recv_intra + self.recv_inter

    @property
    def sent(self) -> int:
        return self.sent_intra + self.sent_inter

    @property
    def shard_bytes(self) -> int:
        """Every byte of its engine shard (SyncReport.shard_bytes): copied locally or received."""
        return self.local_bytes + self.received

    @property
    def copies(self) -> int:
        return self.copies_pre + self.copies_post

    @property
    def packed_bytes(self) -> int:
        return self.packed_sent + self.packed_received

    def add(self, tally: Dict[str, int], phases: Dict[str, float], round_s: float) -> None:
        for key in _KEYS:
            setattr(self, key, getattr(self, key) + tally[key])
        for term, value in (*phases.items(), ("round", round_s)):
            self.terms[term] = self.terms.get(term, 0.0) + value
            self.seconds += value


def round_phases(s: Dict[str, int], links: Links) -> Dict[str, float]:
    """One rank's round in the order transport._exchange_round runs it, in seconds: `pre` (its
    local copies and packing what it sends: per-Copy host work + local bytes at the copy rate +
    packed bytes at the packing rate), `network` (the slower direction: links are full duplex and
    all messages are posted at once; within a direction NVLink and InfiniBand bytes add up), `post`
    (writing what it received: per-Copy host work + unpacked bytes at the copy rate)."""
    send = (s["sent_intra"] / links.nvlink_gbps + s["sent_inter"] / links.ib_gbps) / 1e9 \
        + s["messages"] * links.message_us * 1e-6
    recv = (s["recv_intra"] / links.nvlink_gbps + s["recv_inter"] / links.ib_gbps) / 1e9 \
        + s["messages_received"] * links.message_us * 1e-6
    copy_s, hbm_s, pack_s = links.copy_us * 1e-6, 1 / (links.hbm_gbps * 1e9), 1 / (links.pack_gbps * 1e9)
    return {"pre": s["copies_pre"] * copy_s + s["local_bytes"] * hbm_s + s["packed_sent"] * pack_s,
            "network": max(send, recv),
            "post": s["copies_post"] * copy_s + s["packed_received"] * hbm_s}


@dataclass
class Timing:
    """Seconds of the whole sync under three schedules of the same per-rank rounds."""
    seconds: float          # dependency schedule (transport.py's order): a rank's messages of a
                            # round flow once it and its peers have posted theirs (after their
                            # `pre`), take its `network` time, then it unpacks (`post`); it
                            # waits for nobody else, and walks rounds it has no part in
    seconds_barrier: float  # every phase of every round a barrier of all ranks (an upper bound)
    seconds_rank_bound: float  # the busiest rank's own rounds back to back (a lower bound)
    rounds: int
    ranks_per_round: float  # mean ranks exchanging messages in a round
    receivers_per_round: float  # mean ranks receiving in a round


_KEYS = ("recv_intra", "recv_inter", "sent_intra", "sent_inter", "local_bytes", "packed_sent",
         "packed_received", "messages", "messages_received", "copies_pre", "copies_post")


def _tally(copies, node_of: Tuple[int, ...]):
    """One round as transport._exchange_round runs it: each rank's traffic, its buffer bytes
    (packed sends + receives), and each rank's peers."""
    per: Dict[int, Dict[str, int]] = {}
    packed: Dict[Tuple[int, int, str], int] = {}  # (src, dst, dtype) -> bytes in one buffer
    alloc: Dict[int, int] = {}
    peers: Dict[int, set] = {}
    for c in copies:
        src, dst, nbytes = c.src, c.dst, c.nbytes
        d = per.get(dst)
        if d is None:
            d = per[dst] = dict.fromkeys(_KEYS, 0)
        if src == dst:
            d["copies_pre"] += 1
            d["local_bytes"] += nbytes
            continue
        s = per.get(src)
        if s is None:
            s = per[src] = dict.fromkeys(_KEYS, 0)
        s["copies_pre"] += 1
        d["copies_post"] += 1
        where = "intra" if node_of[src] == node_of[dst] else "inter"
        d["recv_" + where] += nbytes
        s["sent_" + where] += nbytes
        peers.setdefault(src, set()).add(dst)
        peers.setdefault(dst, set()).add(src)
        if c.direct:  # the transport's own rule: a message of its own, or packed
            s["messages"] += 1
            d["messages_received"] += 1
        else:
            packed[(src, dst, c.wire)] = packed.get((src, dst, c.wire), 0) + nbytes
            s["packed_sent"] += nbytes
            d["packed_received"] += nbytes
            alloc[src] = alloc.get(src, 0) + nbytes
            alloc[dst] = alloc.get(dst, 0) + nbytes
    for src, dst, _ in packed:  # one message per (peer, wire dtype)
        per[src]["messages"] += 1
        per[dst]["messages_received"] += 1
    return per, alloc, peers


class _Schedule:
    """When each rank is free in the dependency schedule (Timing.seconds). A rank runs only its
    own share of each round (Plan.rank_work): rounds it has no part in cost it nothing."""

    def __init__(self):
        self.ready: Dict[int, float] = {}

    def free(self, rank: int) -> float:
        return self.ready.get(rank, 0.0)

    def round(self, phases: Dict[int, Dict[str, float]], peers: Dict[int, set], round_s: float) -> None:
        posted = {rank: self.free(rank) + p["pre"] for rank, p in phases.items()}
        for rank, p in phases.items():
            start = max([posted[rank]] + [posted[peer] for peer in peers.get(rank, ())])
            self.ready[rank] = start + p["network"] + p["post"] + round_s


def plan_stats(plan: Plan, node_of: Tuple[int, ...], itemsize: int, links: Links = DEFAULT_LINKS,
               ) -> Tuple[Dict[int, RankStats], Timing]:
    """Every rank's RankStats and the sync's Timing, in one pass over the plan. `itemsize`: bytes
    per element of the engine's tensors (peak memory: a bucket's opened engine tensors + its
    largest round's buffers, as sync._stream counts it: an FP8 tensor its senders quantize opens
    as codes and scales)."""
    stats: Dict[int, RankStats] = {}
    module_bytes: Dict[int, Dict[str, int]] = {}
    for rank, tensors in plan.tensors.items():
        mine = module_bytes.setdefault(rank, {})
        quantized = plan.quantized(rank)
        for t in tensors:
            mine[t.module] = mine.get(t.module, 0) + opened_bytes(t, itemsize, quantized)
    schedule, barrier, rounds, exchanging, receiving = _Schedule(), 0.0, 0, 0, 0
    round_s = links.round_us * 1e-6
    for bucket in plan.buckets:
        buffers: Dict[int, int] = {}
        for copies in bucket.rounds:
            rounds += 1
            per, alloc, peers = _tally(copies, node_of)
            phases = {rank: round_phases(tally, links) for rank, tally in per.items()}
            schedule.round(phases, peers, round_s)
            for rank, tally in per.items():
                st = stats.setdefault(rank, RankStats(rank))
                st.add(tally, phases[rank], round_s)
            exchanging += len(peers)
            receiving += sum(1 for tally in per.values() if tally["messages_received"])
            barrier += sum(max((p[phase] for p in phases.values()), default=0.0)
                           for phase in ("pre", "network", "post")) + round_s
            for rank, nbytes in alloc.items():
                buffers[rank] = max(buffers.get(rank, 0), nbytes)
        for rank in set(buffers) | set(module_bytes):
            opened = sum(module_bytes.get(rank, {}).get(m, 0) for m in bucket.modules.get(rank, ()))
            st = stats.setdefault(rank, RankStats(rank))
            st.peak_bytes = max(st.peak_bytes, opened + buffers.get(rank, 0))
    timing = Timing(seconds=max((schedule.free(r) for r in range(len(node_of))), default=0.0),
                    seconds_barrier=barrier,
                    seconds_rank_bound=max((st.seconds for st in stats.values()), default=0.0),
                    rounds=rounds, ranks_per_round=exchanging / max(rounds, 1),
                    receivers_per_round=receiving / max(rounds, 1))
    return stats, timing


def _signature(dims: ParallelDims, engine: Tuple[int, ...], gpus_per_node: int) -> Tuple:
    """What decides an engine's receiving side: for each of its ranks, the training coordinates
    that fix which pieces it holds (pp, tp, ep, etp), and those of every rank on its node."""
    def held(rank: int) -> Tuple[int, int, int, int]:
        c = rank_coords(dims, rank)
        return (c.pp, c.tp, c.ep, c.etp)

    def node(rank: int) -> FrozenSet:
        first = rank // gpus_per_node * gpus_per_node
        return frozenset(held(q) for q in range(first, first + gpus_per_node))
    return tuple((held(rank), node(rank)) for rank in engine)


def planned_engines(dims: ParallelDims, rollout: RolloutLayout, gpus_per_node: int) -> List[int]:
    """One engine of each distinct signature, the lowest-numbered."""
    seen, chosen = set(), []
    for engine, ranks in enumerate(rollout.engines(dims.world_size)):
        key = _signature(dims, ranks, gpus_per_node)
        if key not in seen:
            seen.add(key)
            chosen.append(engine)
    return chosen


@dataclass
class ClusterPlan:
    arch: ModelArch
    dims: ParallelDims
    rollout: RolloutLayout
    nodes: int
    gpus_per_node: int
    bucket_bytes: int
    links: Links
    engines: int
    engines_planned: List[int]
    ranks: Dict[int, RankStats]   # the planned engines' ranks, and every rank that sends to them
    timing: Timing
    buckets: int
    copies: int
    model_bytes: int
    plan_seconds: float           # wall time of layout_pieces + vllm_layout + build_plan
    stats_seconds: float
    quantization: str = "none"    # "fp8": block-FP8 engines (fp8_layout.quantized_layout)
    router_fp32: bool = True      # the engines hold their MoE gates in fp32 (engine_fp32)
    # FP8 engine tensors of the planned engines' ranks (one per rank holding it), by who quantizes
    # them: their senders (codes and scales travel) or the receiving rank (the model's dtype does)
    quantized_by_senders: int = 0
    quantized_by_receivers: int = 0

    @property
    def world(self) -> int:
        return self.dims.world_size

    @property
    def seconds(self) -> float:
        return self.timing.seconds

    @property
    def complete(self) -> bool:
        return len(self.engines_planned) == self.engines

    def receivers(self) -> List[RankStats]:
        planned = set(self.engines_planned)
        return [s for s in self.ranks.values() if s.rank // self.rollout.size in planned]

    def note(self) -> str:
        if self.complete:
            return "every engine planned: every figure is the full plan's"
        return (f"{len(self.engines_planned)} of {self.engines} engines planned, one per distinct "
                "placement (the training coordinates of its ranks and of their nodes' ranks): every "
                "other engine receives, intra- and inter-node, and copies locally exactly what its "
                "planned twin does, so bytes received and shard bytes hold for every rank; what "
                "ranks send, messages and the seconds count the planned engines' demand only (lower "
                "bounds), and the peak is an estimate (with fewer senders, rounds and buckets split "
                "later than in the full plan)")

    def gpu_note(self) -> dict:
        """The GPU kind whose measured constants cost the plan, and any set apart from them."""
        kind = gpu_kinds.KINDS[self.links.gpu]
        return {"kind": kind.name, "measured_on": kind.device, "measured": kind.measured,
                **{name: getattr(self.links, name) for name in MEASURED},
                "set_apart": self.links.departures()}

    def summary(self) -> dict:
        recv = self.receivers()
        every = list(self.ranks.values())
        worst = max(every, key=lambda s: s.seconds)
        return {
            "seconds": self.timing.seconds,
            "seconds_barrier": self.timing.seconds_barrier,
            "seconds_rank_bound": self.timing.seconds_rank_bound,
            "max_bytes_received_per_rank": max(s.received for s in recv),
            "max_bytes_sent_per_rank": max(s.sent for s in every),
            "max_bytes_inter_node_per_rank": max(max(s.recv_inter, s.sent_inter) for s in every),
            "max_bytes_inter_node_received_per_rank": max(s.recv_inter for s in recv),
            "max_bytes_inter_node_sent_per_rank": max(s.sent_inter for s in every),
            "max_bytes_local_per_rank": max(s.local_bytes for s in recv),
            "max_shard_bytes_per_rank": max(s.shard_bytes for s in recv),
            "messages": sum(s.messages for s in every),
            "max_messages_per_rank": max(s.messages for s in every),
            "max_messages_received_per_rank": max(s.messages_received for s in recv),
            "peak_bytes_per_rank": max(s.peak_bytes for s in recv),
            "busiest_rank": worst.rank,
            "busiest_rank_seconds_by_term": worst.terms,
            "model_bytes": self.model_bytes,
            "engines": self.engines,
            "engines_planned": len(self.engines_planned),
            "world": self.world,
            "nodes": self.nodes,
            "gpus_per_node": self.gpus_per_node,
            "train": self.dims.describe(),
            "rollout": {"tp": self.rollout.tp, "ep": self.rollout.ep, "engine_size": self.rollout.size},
            "dtype": self.arch.dtype,
            "bucket_bytes": self.bucket_bytes,
            "buckets": self.buckets,
            "rounds": self.timing.rounds,
            "ranks_per_round": self.timing.ranks_per_round,
            "receivers_per_round": self.timing.receivers_per_round,
            "copies": self.copies,
            "quantization": self.quantization,
            "quantized_by_senders": self.quantized_by_senders,
            "quantized_by_receivers": self.quantized_by_receivers,
            "plan_wall_seconds": self.plan_seconds,
            "stats_wall_seconds": self.stats_seconds,
            "assumptions": asdict(self.links),
            "gpu": self.gpu_note(),
            "complete": self.complete,
            "floor": max(worst.terms, key=worst.terms.get),  # the busiest rank's largest term
            "note": self.note(),
        }


def plan_cluster(arch: ModelArch, dims: ParallelDims, rollout: RolloutLayout, gpus_per_node: int,
                 bucket_bytes: int, links: Links = DEFAULT_LINKS, max_regions: int = MAX_REGIONS,
                 engines: Optional[List[int]] = None, quantization: str = "none",
                 router_fp32: bool = True) -> ClusterPlan:
    """Plan the sync of `arch` from training layout `dims` into engines `rollout` on nodes of
    `gpus_per_node` consecutive ranks. `engines`: which engines to plan (default: all, or one
    per distinct placement when that would exceed `max_regions` regions); `quantization` "fp8":
    block-FP8 engines (rollout.quantization), a layout whose slices are not whole blocks refused;
    `router_fp32`: the engines hold their MoE gates in fp32 (model.router_fp32), counted so."""
    world = dims.world_size
    if gpus_per_node < 1 or world % gpus_per_node:
        raise ValueError(f"gpus per node {gpus_per_node} must divide the world size {world}")
    check_rollout(arch, rollout, world)
    start = time.perf_counter()
    pieces = layout_pieces(arch, dims)
    layout = engine_fp32.fp32_layout(arch, vllm_layout(arch, rollout, world), router_fp32)
    if quantization == "fp8":
        layout = fp8_layout.quantized_layout(arch, rollout, layout)
    elif quantization != "none":
        raise ValueError(f"quantization {quantization!r}: expected 'none' or 'fp8'")
    every_engine = rollout.engines(world)
    count = len(every_engine)
    if engines is None:
        regions = sum(len(t.regions) for rank in range(world) for t in layout[rank])
        engines = list(range(count)) if regions <= max_regions else planned_engines(
            dims, rollout, gpus_per_node)
    bad = [e for e in engines if not 0 <= e < count]
    if bad or not engines:
        raise ValueError(f"engines {bad or engines} outside the {count} engines")
    wanted = set(engines)
    receiving = {rank for e in wanted for rank in every_engine[e]}
    subset = tuple((rank, tensors) for rank, tensors in sorted(layout.items()) if rank in receiving)
    node_of = tuple(rank // gpus_per_node for rank in range(world))
    plan = build_plan(pieces, subset, bucket_bytes, node_of, every_engine)
    planned = time.perf_counter()
    itemsize = DTYPES[arch.dtype].itemsize
    ranks, timing = plan_stats(plan, node_of, itemsize, links)
    fp8 = [(rank, t.name) for rank, tensors in subset for t in tensors if t.fp8]
    by_senders = sum(len(plan.quantized(rank)) for rank, _ in subset)
    return ClusterPlan(
        arch=arch, dims=dims, rollout=rollout, nodes=world // gpus_per_node,
        gpus_per_node=gpus_per_node, bucket_bytes=bucket_bytes, links=links, engines=count,
        engines_planned=sorted(wanted), ranks=ranks, timing=timing,
        buckets=len(plan.buckets), copies=sum(len(b.copies) for b in plan.buckets),
        model_bytes=metadata.model_bytes(pieces), plan_seconds=planned - start,
        stats_seconds=time.perf_counter() - planned, quantization=quantization, router_fp32=router_fp32,
        quantized_by_senders=by_senders, quantized_by_receivers=len(fp8) - by_senders)


def gb(nbytes: float) -> str:
    return f"{nbytes / 1e9:.3f} GB"


def arithmetic(st: RankStats, links: Links) -> str:
    """One rank's own seconds written out (the rank-bound model: its rounds back to back)."""
    def direction(intra: int, inter: int, messages: int) -> str:
        seconds = (intra / links.nvlink_gbps + inter / links.ib_gbps) / 1e9 \
            + messages * links.message_us * 1e-6
        return (f"{gb(intra)} / {links.nvlink_gbps:g} + {gb(inter)} / {links.ib_gbps:g} GB/s + {messages} "
                f"msgs x {links.message_us:g} us = {seconds:.3f} s")
    t, hbm = st.terms, links.hbm_gbps
    return (f"rank {st.rank}: pre {st.copies_pre} copies x {links.copy_us:g} us + {gb(st.local_bytes)} "
            f"local / {hbm:g} GB/s + {gb(st.packed_sent)} packed / {links.pack_gbps:g} GB/s = "
            f"{t.get('pre', 0):.3f} s; "
            f"network: receive {direction(st.recv_intra, st.recv_inter, st.messages_received)}, send "
            f"{direction(st.sent_intra, st.sent_inter, st.messages)}, the larger per round, summed "
            f"= {t.get('network', 0):.3f} s; post {st.copies_post} copies x {links.copy_us:g} us + "
            f"{gb(st.packed_received)} unpacked / {hbm:g} GB/s = {t.get('post', 0):.3f} s; rounds "
            f"{t.get('round', 0):.3f} s; total {st.seconds:.3f} s")
