"""push_weights: the actor's newest weights into a destination, the adapters alone where it takes
them (WeightLayout.adapters: a vLLM engine serves them from its LoRA slots, or merges them into its
weights itself), the whole model otherwise (sync.sync_weights).

The base weights are frozen: the first sync writes them (unmerged) and every sync after it moves
only the adapters. Each adapter shard (one TP piece of one A or B; DP and CP
replicas hold the same bytes) goes from a rank that holds it (adapter_plan.routes: the receiver
itself, else one on its node) to each rank of the destination, point to point over the sync's
Links (all of one rank's parts for one peer in one message per dtype), and is counted by the
transport (transport.Traffic) as it is posted. Each destination rank ends up with every adapter
tensor whole, which vLLM cuts for its own tensor parallelism when it loads them into a slot
(rollout/vllm/lora.py), or the engine when it merges them (rollout/vllm/merge.py).
"""

import math
import time
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch

from megarl.models.hf.config import ModelArch
from megarl.models.lora import peft_io
from megarl.parallel_state.links import Links, WorldLinks
from megarl.resharding import adapter_plan, transport
from megarl.resharding.sync import DEFAULT_BUCKET_BYTES, SyncReport, node_of_ranks, sync_weights
from megarl.rollout.engine import WeightDestination


@dataclass
class AdapterSyncReport:
    base: Optional[SyncReport]  # the base weights' sync, when this push wrote them
    adapter_bytes: int          # every adapter tensor once: what each destination rank must hold
    bytes_received: int         # this rank, from other ranks (counted by the transport)
    bytes_sent: int             # this rank, to other ranks
    local_bytes: int            # this rank, from its own adapters into its engine
    messages: int               # point-to-point sends posted by this rank
    sync_seconds: float         # the adapters' move and load (the base's sync not included)

    @property
    def engine_bytes(self) -> int:
        """What this rank's engine took in: the adapters, and the base when this push wrote it."""
        return self.local_bytes + self.bytes_received + (self.base.engine_bytes if self.base else 0)

    @property
    def pushed_bytes(self) -> int:
        """What this rank sent to other ranks: the adapters, and the base when this push wrote it."""
        return self.bytes_sent + (self.base.bytes_sent if self.base else 0)


def push_weights(chunks: List[torch.nn.Module], arch: ModelArch, engine: WeightDestination,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, links: Optional[Links] = None):
    """What every sync of a run calls: sync_weights' SyncReport without slots, AdapterSyncReport
    with them. Collective over `links` (None: the default world)."""
    if not engine.weight_layout().adapters:
        return sync_weights(chunks, arch, engine, bucket_bytes, links)
    links = links or WorldLinks()
    base = None
    if any(links.all_gather_object(engine.needs_base_weights())):
        base = sync_weights(chunks, arch, engine, bucket_bytes, links, merge_adapters=False)
    return sync_adapters(chunks, engine, links, base)


def _receivers(engine: WeightDestination) -> range:
    layout = engine.weight_layout()
    return range(layout.first_rank, layout.first_rank + layout.world)


@torch.no_grad()
def sync_adapters(chunks: List[torch.nn.Module], engine: WeightDestination, links: Links,
                  base: Optional[SyncReport] = None) -> AdapterSyncReport:
    """Every adapter tensor whole onto each destination rank, loaded there (engine.load_adapters)."""
    start = time.perf_counter()
    mine = peft_io.local_shards(chunks)
    held = links.all_gather_object([(shard, tuple(t.shape), str(t.dtype)) for shard, t in mine])
    holders: Dict[tuple, List[int]] = {}
    meta: Dict[tuple, Tuple[peft_io.Shard, tuple, str]] = {}
    for rank, items in enumerate(held):
        for shard, shape, dtype in items:
            holders.setdefault(shard.slot, []).append(rank)
            meta[shard.slot] = (shard, shape, dtype)
    if not holders:
        raise RuntimeError("adapter sync: no rank holds adapters (an actor without LoRA syncs whole)")
    holders = {slot: holders[slot] for slot in sorted(holders, key=repr)}  # one order on every rank
    tensor_of = {shard.slot: tensor for shard, tensor in mine}
    receivers, me = _receivers(engine), links.rank
    outgoing: Dict[Tuple[int, str], List[torch.Tensor]] = {}  # (peer, dtype) -> what goes in one message
    incoming: Dict[Tuple[int, str], List[Tuple[peft_io.Shard, tuple]]] = {}
    received, traffic = [], transport.Traffic()
    for slot, chosen in adapter_plan.routes(holders, receivers, node_of_ranks(links.size)).items():
        shard, shape, dtype = meta[slot]
        for receiver, sender in chosen.items():
            if sender == me and receiver != me:
                outgoing.setdefault((receiver, dtype), []).append(tensor_of[slot].reshape(-1))
        if me not in chosen:
            continue
        if chosen[me] == me:
            received.append((shard, tensor_of[slot]))
            traffic.local_bytes += tensor_of[slot].numel() * tensor_of[slot].element_size()
        else:
            incoming.setdefault((chosen[me], dtype), []).append((shard, shape))
    sends = [(torch.cat(parts), peer) for (peer, _), parts in outgoing.items()]
    recvs = [(torch.empty(sum(math.prod(shape) for _, shape in parts), dtype=transport.TORCH_DTYPES[dtype],
                          device=links.device), peer) for (peer, dtype), parts in incoming.items()]
    traffic.post(sends, recvs)
    links.exchange(sends, recvs)
    for (flat, _), parts in zip(recvs, incoming.values()):
        pieces = flat.split([math.prod(shape) for _, shape in parts])
        received += [(shard, piece.view(shape)) for (shard, shape), piece in zip(parts, pieces)]
    if me in receivers:
        engine.load_adapters(peft_io.assemble(received))
    adapter_bytes = sum(math.prod(shape) * transport.TORCH_DTYPES[dtype].itemsize
                        for _, shape, dtype in meta.values())
    return AdapterSyncReport(base=base, adapter_bytes=adapter_bytes,
                             bytes_received=sum(traffic.received.values()),
                             bytes_sent=sum(traffic.sent.values()), local_bytes=traffic.local_bytes,
                             messages=traffic.messages_sent, sync_seconds=time.perf_counter() - start)

