"""sync_weights: the actor's newest weights into the rollout engine, in buckets, verified.

The one public call of megarl.resharding. Collective over its Links: the training world when the
engines are colocated, the trainer-rollout bridge when they are disaggregated (the sources are
then the trainer ranks, the destination the rollout ranks from the layout's first_rank). Each rank
receives only the bytes of its own engine shard, point to point, and writes them straight into
the engine's tensors (see plan.py and transport.py); the metadata exchange and the plan happen
once per layout pair, not once per sync.
"""

import os
import time
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch

from megarl.models.hf_config import ModelArch
from megarl.parallel_state import device_memory
from megarl.parallel_state.links import Links, WorldLinks
from megarl.resharding import destination, metadata, transport
from megarl.resharding.plan import Plan, build_plan
from megarl.rollout.engine import WeightDestination, WeightLayout, check_update

DEFAULT_BUCKET_BYTES = 256 * 2**20


@dataclass
class SyncReport:
    params_synced: int        # engine parameters written
    params_expected: int      # engine parameters that exist
    buckets: int
    sync_seconds: float
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
                              # engine's own processing included (parallel_state/device_memory.py)
    model_bytes: int          # every full tensor of the model once
    largest_tensor_bytes: int  # this rank's largest destination module (opened at once)


def layout_tensors(arch: ModelArch, layout: WeightLayout, role: str = "policy"):
    """Every receiving rank's destination tensors for a destination's declared layout, keyed by
    its rank in the sync (from `layout.first_rank`), and the independent engines' ranks."""
    first = layout.first_rank
    if layout.format == "vllm":
        rollout = destination.RolloutLayout(layout.tp, layout.ep)
        tensors = destination.vllm_layout(arch, rollout, layout.world, role)
        return {first + r: t for r, t in tensors.items()}, rollout.engines(layout.world, first)
    if layout.format == "hf":
        return {first: destination.hf_tensors(arch, role)}, ((first,),)
    raise ValueError(f"unknown weight layout format {layout.format!r}: expected 'vllm' or 'hf'")


def node_of_ranks(world: int) -> Tuple[int, ...]:
    """Each rank's node, from the launcher's ranks-per-node (torchrun and megarl's Ray launch
    set LOCAL_WORLD_SIZE); the plan prefers a replica on the receiver's own node."""
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world)) or world
    return tuple(rank // per_node for rank in range(world))


@torch.no_grad()
def sync_weights(chunks: List[torch.nn.Module], arch: ModelArch, engine: WeightDestination,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, links: Optional[Links] = None) -> SyncReport:
    """`chunks`: this rank's Megatron chunks (none on a rollout rank); `engine`: what this rank
    writes into (on a trainer rank of a disaggregated job, a destination holding nothing);
    `links`: the ranks of the sync (None: the default world)."""
    start = time.perf_counter()
    links = links or WorldLinks()
    rank = links.rank
    mine, local = metadata.local_pieces(chunks, arch, rank)
    pieces = metadata.all_pieces(mine, links)
    weight_layout = engine.weight_layout()
    layout, engines = layout_tensors(arch, weight_layout)
    plan = build_plan(pieces, tuple(sorted(layout.items())), bucket_bytes, node_of_ranks(links.size),
                      engines)
    with device_memory.measured() as measured:  # the engine's finishing work (repacking) too
        peak, traffic = _stream(plan, engine, local, links)
        report = check_update(engine.finish_weight_update())
    module_bytes: Dict[str, int] = {}
    for tensor in plan.tensors.get(rank, ()):
        module_bytes[tensor.module] = module_bytes.get(tensor.module, 0) + tensor.numel
    itemsize = torch.empty((), dtype=arch.torch_dtype).element_size()
    return SyncReport(params_synced=report.params_loaded, params_expected=report.params_expected,
                      buckets=len(plan.buckets), sync_seconds=time.perf_counter() - start,
                      bytes_received=sum(traffic.received.values()), bytes_sent=sum(traffic.sent.values()),
                      local_bytes=traffic.local_bytes, messages=traffic.messages_sent,
                      messages_received=traffic.messages_received, received_from=traffic.received,
                      sent_to=traffic.sent, shard_bytes=plan.shard_bytes(rank),
                      peak_extra_bytes=peak, measured_peak_bytes=measured.extra_bytes,
                      model_bytes=metadata.model_bytes(pieces),
                      largest_tensor_bytes=max(module_bytes.values(), default=0) * itemsize)


def _stream(plan: Plan, engine: WeightDestination, local: Dict[Tuple[str, int], torch.Tensor],
            links: Links) -> Tuple[int, transport.Traffic]:
    """Every bucket into the engine, in plan order; returns (planned peak extra bytes, what the
    transport moved)."""
    rank = links.rank
    mine = {t.name: t for t in plan.tensors.get(rank, ())}
    engine.begin_weight_update({name: t.shape for name, t in mine.items()})
    peak, traffic = 0, transport.Traffic()
    for bucket, rounds in zip(plan.buckets, plan.rank_work(rank)):
        modules = set(bucket.modules.get(rank, ()))
        names = [name for name, t in mine.items() if t.module in modules]
        targets = engine.open_tensors(names)
        for name in names:
            if mine[name].covered < mine[name].numel:  # padding rows nothing writes
                targets[name].zero_()
        opened = sum(t.numel() * t.element_size() for t in targets.values())
        buffers = transport.exchange(rounds, links, local, targets, traffic)
        del targets
        engine.close_tensors(names)
        peak = max(peak, opened + buffers)
    return peak, traffic
