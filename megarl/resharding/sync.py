"""sync_weights: the actor's newest weights into the rollout engine, in buckets, verified.

The one public call of megarl.resharding. Collective over its Links: the training world when the
engines are colocated, the trainer-rollout bridge when they are disaggregated (the sources are
then the trainer ranks, the destination the rollout ranks from the layout's first_rank). Each rank
receives only the bytes of its own engine shard, point to point, and writes them straight into
the engine's tensors (see plan.py and transport.py). The destination layout, the plan and this
rank's share of it are built by the first sync of a layout and weights' shapes; later ones
exchange one digest per rank, find that share as it was built (rank_plan) and only move bytes.
"""

import functools
import os
import time
from dataclasses import dataclass
from typing import Dict, FrozenSet, List, Optional, Tuple

import torch

from megarl.models.hf import fp8_blocks
from megarl.models.hf.config import ModelArch
from megarl.models.weights import destination, engine_fp32, fp8_layout
from megarl.parallel_state.links import Links, WorldLinks
from megarl.platform import device_memory
from megarl.resharding import metadata, transport
from megarl.resharding.plan import Copy, Plan, build_plan, opened_bytes
from megarl.rollout.engine import WeightDestination, WeightLayout, check_update

DEFAULT_BUCKET_BYTES = 256 * 2**20


@dataclass
class SyncReport:
    params_synced: int        # engine parameters written
    params_expected: int      # engine parameters that exist
    buckets: int
    sync_seconds: float
    plan_seconds: float       # of sync_seconds: reading and exchanging the metadata and finding this
                              # rank's plan, or building it (the first sync of a layout and shapes)
    plan_built: bool          # this sync built its plan (False: it reused an earlier sync's)
    # Counted by the transport as it posts each message (transport.Traffic), not from the plan:
    bytes_received: int       # this rank, from other ranks
    bytes_sent: int           # this rank, to other ranks
    local_bytes: int          # this rank, from its own parameters into its engine (no message)
    messages: int             # point-to-point sends posted by this rank
    messages_received: int    # point-to-point receives posted by this rank
    received_from: Dict[Tuple[int, str], int]  # (peer, dtype) -> bytes received from it
    sent_to: Dict[Tuple[int, str], int]        # (peer, dtype) -> bytes sent to it
    # Planned:
    shard_bytes: int          # this rank's engine shard: what it must end up holding (a correct
                              # transport moves local_bytes + bytes_received == shard_bytes)
    peak_extra_bytes: int     # planned: most memory the sync allocated at once on this rank
                              # (send and receive buffers, plus the opened engine tensors)
    measured_peak_bytes: int  # measured: this rank's peak extra memory during the sync, the
                              # engine's own processing included (platform/device_memory.py)
    model_bytes: int          # every full tensor of the model once
    largest_tensor_bytes: int  # this rank's largest destination module (opened at once)
    quantized_by_senders: int  # this rank's FP8 engine tensors that came as codes and scales
                               # (resharding/plan.py); its engine quantized its other FP8 ones

    @property
    def engine_bytes(self) -> int:
        """What this rank's engine took in: from its own parameters and from other ranks."""
        return self.local_bytes + self.bytes_received

    @property
    def pushed_bytes(self) -> int:
        """What this rank sent to other ranks."""
        return self.bytes_sent


def layout_tensors(arch: ModelArch, layout: WeightLayout, role: str = "policy"):
    """Every receiving rank's destination tensors for a destination's declared layout, keyed by
    its rank in the sync (from `layout.first_rank`), and the independent engines' ranks."""
    first = layout.first_rank
    if layout.format == "vllm":
        rollout = destination.RolloutLayout(layout.tp, layout.ep)
        tensors = engine_fp32.fp32_layout(arch, destination.vllm_layout(arch, rollout, layout.world, role),
                                          layout.router_fp32)
        if layout.quantization == "fp8":
            tensors = fp8_layout.quantized_layout(arch, rollout, tensors)
        return {first + r: t for r, t in tensors.items()}, rollout.engines(layout.world, first)
    if layout.format == "hf":
        return {first: destination.hf_tensors(arch, role)}, ((first,),)
    raise ValueError(f"unknown weight layout format {layout.format!r}: expected 'vllm' or 'hf'")


def node_of_ranks(world: int) -> Tuple[int, ...]:
    """Each rank's node, from the launcher's ranks-per-node (torchrun and megarl's Ray launch
    set LOCAL_WORLD_SIZE); the plan prefers a replica on the receiver's own node."""
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world)) or world
    return tuple(rank // per_node for rank in range(world))


@dataclass(frozen=True, eq=False)
class RankPlan:
    """One rank's share of a plan, as a sync reads it. The whole plan (every rank's copies: 2.4M
    at Qwen3-235B TP8) is dropped once this is taken from it. `buckets`: per bucket, the tensors
    this rank opens (in its layout's order, which the engine finishes modules in) and its own
    copies, round by round (Plan.rank_work)."""
    buckets: Tuple[Tuple[Tuple[str, ...], Tuple[Tuple[Copy, ...], ...]], ...]
    expected: Dict[str, Tuple[int, ...]]  # this rank's destination tensors: name -> shape (and the
                                          # scales of those its senders quantize: Plan.quantized)
    padded: FrozenSet[str]          # those with rows no copy writes (vocabulary padding): zeroed
    quantized: FrozenSet[str]       # FP8 ones whose senders quantize them (Plan.quantized)
    shard_bytes: int
    model_bytes: int
    largest_tensor_bytes: int       # its largest destination module (opened at once)


@functools.lru_cache(maxsize=4)  # a run syncs into its engines and exports to HF: two layouts
def rank_plan(arch: ModelArch, weight_layout: WeightLayout, gathered: metadata.Gathered,
              bucket_bytes: int, node_of: Tuple[int, ...], rank: int) -> RankPlan:
    """This rank's share of the plan from `gathered`'s pieces into `weight_layout`, built on the
    first call and the same object on every later one with equal arguments. Every argument is
    a few small values (Gathered hashes its key only), so finding it costs microseconds; the
    layout and the plan themselves are millions of objects, which hashing and comparing on every
    sync cost seconds at Qwen3-235B. Any change of layout, bucket size or any rank's weight shapes
    changes an argument, and builds a new one."""
    layout, engines = layout_tensors(arch, weight_layout)
    plan = build_plan(gathered.pieces, tuple(sorted(layout.items())), bucket_bytes, node_of, engines)
    return _share(plan, rank, metadata.model_bytes(gathered.pieces),
                  torch.empty((), dtype=arch.torch_dtype).element_size())


def _share(plan: Plan, rank: int, model_bytes: int, itemsize: int) -> RankPlan:
    """A tensor its senders quantize is opened with its scales (its codes and its scales are
    written); the rank's engine learns which from `expected`."""
    mine = plan.tensors.get(rank, ())
    quantized = plan.quantized(rank)
    scales = {fp8_blocks.scale_name(t.name): fp8_layout.scale_shape(t.shape)
              for t in mine if t.name in quantized}
    bucket_of = {module: b for b, bucket in enumerate(plan.buckets)
                 for module in bucket.modules.get(rank, ())}
    names: List[List[str]] = [[] for _ in plan.buckets]
    module_bytes: Dict[str, int] = {}
    for tensor in mine:
        if tensor.module in bucket_of:
            names[bucket_of[tensor.module]].append(tensor.name)
            if tensor.name in quantized:
                names[bucket_of[tensor.module]].append(fp8_blocks.scale_name(tensor.name))
        module_bytes[tensor.module] = (module_bytes.get(tensor.module, 0)
                                       + opened_bytes(tensor, itemsize, quantized))
    return RankPlan(buckets=tuple(zip(map(tuple, names), plan.rank_work(rank))),
                    expected={**{t.name: t.shape for t in mine}, **scales},
                    padded=frozenset(t.name for t in mine if t.covered < t.numel), quantized=quantized,
                    shard_bytes=plan.shard_bytes(rank), model_bytes=model_bytes,
                    largest_tensor_bytes=max(module_bytes.values(), default=0))


@torch.no_grad()
def sync_weights(chunks: List[torch.nn.Module], arch: ModelArch, engine: WeightDestination,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, links: Optional[Links] = None,
                 merge_adapters: bool = True) -> SyncReport:
    """`chunks`: this rank's Megatron chunks (none on a rollout rank); `engine`: what this rank
    writes into (on a trainer rank of a disaggregated job, a destination holding nothing);
    `links`: the ranks of the sync (None: the default world); `merge_adapters`: LoRA adapters
    merged into their base weights (False: the base alone, for adapter_sync's slots)."""
    start = time.perf_counter()
    links = links or WorldLinks()
    mine, local = metadata.local_pieces(chunks, arch, links.rank, merge_adapters=merge_adapters)
    misses = rank_plan.cache_info().misses
    work = rank_plan(arch, engine.weight_layout(), metadata.gather(mine, links), bucket_bytes,
                     node_of_ranks(links.size), links.rank)
    built = rank_plan.cache_info().misses > misses
    planned = time.perf_counter()
    with device_memory.measured() as measured:  # the engine's finishing work (repacking) too
        peak, traffic = _stream(work, engine, local, links)
        report = check_update(engine.finish_weight_update())
    return SyncReport(params_synced=report.params_loaded, params_expected=report.params_expected,
                      buckets=len(work.buckets), sync_seconds=time.perf_counter() - start,
                      plan_seconds=planned - start, plan_built=built,
                      bytes_received=sum(traffic.received.values()), bytes_sent=sum(traffic.sent.values()),
                      local_bytes=traffic.local_bytes, messages=traffic.messages_sent,
                      messages_received=traffic.messages_received, received_from=traffic.received,
                      sent_to=traffic.sent, shard_bytes=work.shard_bytes,
                      peak_extra_bytes=peak, measured_peak_bytes=measured.extra_bytes,
                      model_bytes=work.model_bytes, largest_tensor_bytes=work.largest_tensor_bytes,
                      quantized_by_senders=len(work.quantized))


def _stream(work: RankPlan, engine: WeightDestination, local: Dict[Tuple[str, int], torch.Tensor],
            links: Links) -> Tuple[int, transport.Traffic]:
    """Every bucket into the engine, in plan order; returns (planned peak extra bytes, what the
    transport moved)."""
    engine.begin_weight_update(dict(work.expected))  # a copy: the engine may keep it
    peak, traffic = 0, transport.Traffic()
    for names, rounds in work.buckets:
        targets = engine.open_tensors(names)
        for name in names:
            if name in work.padded:  # padding rows nothing writes
                targets[name].zero_()
        opened = sum(t.numel() * t.element_size() for t in targets.values())
        buffers = transport.exchange(rounds, links, local, targets, traffic)
        del targets
        engine.close_tensors(names)
        peak = max(peak, opened + buffers)
    return peak, traffic
