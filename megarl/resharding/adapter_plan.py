"""Who sends each LoRA adapter shard to each engine rank: the routes adapter_sync.py moves and
scripts/plan_sync.py --lora prices, from the same function (routes).

A shard is one TP piece of one adapter A or B (a whole tensor is one shard); DP and CP replicas
hold the same bytes. Every engine rank needs every adapter whole (vLLM cuts them for its own
tensor parallelism as it loads them). A receiver that holds a shard takes it from itself; else
from a holder on its own node if there is one, else from any; receivers take turns over the
holders they choose among (shifted per shard), so no one DP replica serves every engine rank.

Owns the routes and, for the planner, every rank's shards at a cluster layout without weights
(layout_shards: the run's own adapter shapes, lora.full_shapes and lora.split_dim, on the
layout's pieces) and the cost of moving them (plan_adapters).
"""

import math
from dataclasses import dataclass
from typing import Dict, Hashable, List, Sequence, Tuple

from megarl.models.hf.config import DTYPES, ModelArch
from megarl.models.lora.adapters import KINDS, LoraConfig, chosen_parts, full_shapes, kind_of, split_dim
from megarl.models.weights.tables import entry_for
from megarl.parallel_state.dims import ParallelDims
from megarl.resharding.cluster_plan import round_phases
from megarl.resharding.source_layout import layout_pieces


def routes(holders: Dict[Hashable, Sequence[int]], receivers: Sequence[int],
           node_of: Sequence[int]) -> Dict[Hashable, Dict[int, int]]:
    """{shard: {receiver: the rank that sends it}} for `holders` ({shard: ranks holding it}, in
    an order every rank agrees on)."""
    out = {}
    for index, (shard, ranks) in enumerate(holders.items()):
        held, by_node = set(ranks), {}
        for rank in sorted(ranks):
            by_node.setdefault(node_of[rank], []).append(rank)
        everyone = sorted(ranks)
        chosen = {}
        for turn, receiver in enumerate(receivers):
            if receiver in held:
                chosen[receiver] = receiver
            else:
                near = by_node.get(node_of[receiver], everyone)
                chosen[receiver] = near[(turn + index) % len(near)]
        out[shard] = chosen
    return out


def layout_shards(arch: ModelArch, dims: ParallelDims,
                  config: LoraConfig) -> Dict[int, List[Tuple[tuple, int]]]:
    """{rank: [(shard, bytes)]} of the adapters `config` puts on `arch` at `dims`, as lora.attach
    makes them (adapters in the base's dtype); a shard is (weight, HF part, A or B, TP piece)."""
    parts = chosen_parts(arch, config)
    kinds = {kind: KINDS[kind] for kind in parts}
    itemsize = DTYPES[arch.dtype].itemsize
    held: Dict[int, List[Tuple[tuple, int]]] = {rank: [] for rank in range(dims.world_size)}
    for piece in layout_pieces(arch, dims):
        kind = kind_of(kinds, piece.canonical)
        if kind is None:
            continue
        entry = entry_for(arch, piece.canonical)
        fused = [KINDS[kind].expert] if KINDS[kind].expert else [hf.rsplit(".", 2)[-2] for hf in entry.hf]
        transform = "copy" if KINDS[kind].expert else entry.transform
        shapes = full_shapes(KINDS[kind].style, transform, arch, len(fused), piece.shape, piece.tp_size)
        for part, (out_full, in_full) in zip(fused, shapes):
            if part not in parts[kind]:  # a projection without an adapter holds nothing
                continue
            rank_r = config.rank_of(kind, part)
            for which, shape in (("A", [rank_r, in_full]), ("B", [out_full, rank_r])):
                dim = split_dim(KINDS[kind].style, which, piece.tp_size)
                if dim is not None:
                    shape[dim] //= piece.tp_size
                shard = (piece.canonical, part, which, piece.tp_rank if dim is not None else 0)
                held[piece.rank].append((shard, math.prod(shape) * itemsize))
    return held


@dataclass
class AdapterRankStats:
    rank: int
    local_bytes: int = 0
    sent_intra: int = 0
    sent_inter: int = 0
    recv_intra: int = 0
    recv_inter: int = 0
    peers_sent: int = 0       # messages: one per peer (adapter_sync packs a peer's shards together)
    peers_received: int = 0

    def seconds(self, links) -> float:
        """One round in cluster_plan's model: packing what it sends, the slower direction of the
        network, writing what it holds whole (its own shards and the received ones)."""
        phases = round_phases(dict(
            sent_intra=self.sent_intra, sent_inter=self.sent_inter, recv_intra=self.recv_intra,
            recv_inter=self.recv_inter, messages=self.peers_sent, messages_received=self.peers_received,
            copies_pre=0, copies_post=0, local_bytes=self.local_bytes,
            packed_sent=self.sent_intra + self.sent_inter,
            packed_received=self.recv_intra + self.recv_inter), links)
        return sum(phases.values()) + links.round_us * 1e-6

def rank_stats(held: Dict[int, List[Tuple[tuple, int]]], receivers: Sequence[int],
               node_of: Sequence[int]) -> Dict[int, AdapterRankStats]:
    """Every rank's bytes and messages in an adapters-only sync of `held` ({rank: [(shard,
    bytes)]}) onto `receivers`."""
    holders: Dict[tuple, List[int]] = {}
    size: Dict[tuple, int] = {}
    for rank in sorted(held):
        for shard, nbytes in held[rank]:
            holders.setdefault(shard, []).append(rank)
            size[shard] = nbytes
    stats = {rank: AdapterRankStats(rank) for rank in range(len(node_of))}
    pairs = set()
    for shard, chosen in routes(holders, receivers, node_of).items():
        for receiver, sender in chosen.items():
            if sender == receiver:
                stats[receiver].local_bytes += size[shard]
                continue
            side = "intra" if node_of[sender] == node_of[receiver] else "inter"
            setattr(stats[sender], f"sent_{side}", getattr(stats[sender], f"sent_{side}") + size[shard])
            setattr(stats[receiver], f"recv_{side}", getattr(stats[receiver], f"recv_{side}") + size[shard])
            pairs.add((sender, receiver))
    for sender, receiver in pairs:
        stats[sender].peers_sent += 1
        stats[receiver].peers_received += 1
    return stats


def plan_adapters(held: Dict[int, List[Tuple[tuple, int]]], receivers: Sequence[int],
                  node_of: Sequence[int], links) -> dict:
    """What an adapters-only sync moves at this layout and how long it takes (`links`:
    cluster_plan.Links). Not modelled: writing the PEFT folder and vLLM's loading it."""
    stats = rank_stats(held, receivers, node_of)
    size = {shard: nbytes for shards in held.values() for shard, nbytes in shards}
    seconds = {rank: s.seconds(links) for rank, s in stats.items()}
    busiest = max(stats.values(), key=lambda s: seconds[s.rank])
    taken = {stats[r].local_bytes + stats[r].recv_intra + stats[r].recv_inter for r in receivers}
    return {"adapter_bytes": sum(size.values()), "shards": len(size), "receivers": len(receivers),
            # each receiver's local + received bytes: the adapters' bytes, once each
            "receiver_bytes": [min(taken), max(taken)],
            "max_sent_bytes": max(s.sent_intra + s.sent_inter for s in stats.values()),
            "max_sent_inter_bytes": max(s.sent_inter for s in stats.values()),
            "max_messages": max(max(s.peers_sent, s.peers_received) for s in stats.values()),
            "seconds": max(seconds.values()), "busiest_rank": vars(busiest)}
