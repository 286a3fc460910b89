"""MoE router replay: route a forward through given experts, and record the experts each
router used.

The update replays either the rollout engine's routing (R3: the experts that sampled each token)
or the routing recorded in the old-log-prob pass, so it starts from the policy whose log-probs
the loss compares against, even where a router's top-k is a near tie. Recording what the routers
used in the old-log-prob pass, replayed or not, is what the routing-mismatch metric compares
with the engine's.

Owns the per-layer recording, storing it in the batch as [N, L, layers, k] (input-token aligned,
-1 where nothing was routed), independent of micro-batching and parallel layout, and setting each
router's targets right before its chunk's forward: all replayed routing passes there, so that
is where a token without experts in a MoE layer is refused. Uses Megatron-Core's RouterReplay
hooks (the router calls them in its top-k); megarl attaches one per router and drives it per
instance. Does not own which experts a router picks otherwise.
"""

from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

from megarl.actor.packing import PackedMicroBatch, pack_tokens, unpack_tokens
from megarl.actor.schedule import full_pack
from megarl.parallel_state import megatron_groups


class _Replay(RouterReplay):
    """Megatron's hook, also keeping the top-k the router used while it replays."""
    record_used = False

    def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None,
                        default_compute_topk=None):
        probs, indices = super().get_replay_topk(scores, topk, num_groups, group_topk,
                                                 default_compute_topk)
        if self.record_used:
            self.record_indices(indices)
        return probs, indices


def replay_targets(rows: torch.Tensor,  # [n, W, k] one MoE layer's routing of mb's samples
                   mb: PackedMicroBatch, layer: int, topk: int) -> torch.Tensor:
    """The experts this rank's router replays [t/cp, k]. Every token the engine fed through the
    model (all of a sample's but its last) must have experts: a -1 there (a token the engine did
    not capture) is an error, never replaced, or the update would train through experts that
    sampled nothing."""
    fed = torch.arange(rows.shape[1])[None, :] < (mb.lengths - 1)[:, None]  # [n, W]
    missing = fed & (rows < 0).any(-1)
    if missing.any():
        row, position = (int(i) for i in missing.nonzero()[0])
        raise RuntimeError(
            f"no experts to replay for sample {int(mb.rows[row])} (batch row) at token {position} "
            f"of its {int(mb.lengths[row])}, MoE layer {layer}; {int(missing.sum())} tokens of "
            "this micro-batch lack them there. With actor.router_replay=rollout the engine did not "
            "capture them (vLLM's capture must be bound before CUDA-graph capture: "
            "megarl/rollout/vllm/routing.py); megarl refuses to route them through arbitrary experts")
    packed = pack_tokens(rows, mb, -1)[mb.local_index]  # [t/cp, k]
    # Left -1 now: padding, and a sample's last token (the engine never feeds it back). Any valid
    # distinct experts do there: nothing downstream reads their output.
    return torch.where(packed < 0, torch.arange(topk, dtype=packed.dtype), packed)


def _unwrapped(chunk) -> torch.nn.Module:
    """The GPTModel inside a DDP wrapper (schedules hand the wrapper to the forward step)."""
    return chunk.module if hasattr(chunk, "module") else chunk


def _routers(chunk) -> List[Tuple[int, torch.nn.Module]]:
    """(global layer index, router) of the MoE layers in one chunk."""
    return [(layer.layer_number - 1, layer.mlp.router) for layer in _unwrapped(chunk).decoder.layers
            if hasattr(layer.mlp, "router")]


class RoutingReplay:
    def __init__(self, chunks: List[torch.nn.Module], num_layers: int, topk: int):
        self.num_layers, self.topk = num_layers, topk
        self.routers: Dict[int, List[Tuple[int, torch.nn.Module]]] = {}
        for chunk in chunks:
            self.routers[id(_unwrapped(chunk))] = _routers(chunk)
            for _, router in _routers(chunk):
                router.router_replay = _Replay()
        if not any(self.routers.values()) and megatron_groups.pipeline().size == 1:
            raise ValueError("router replay needs MoE routers, and this model has none: set "
                             "actor.router_replay=off")
        # Megatron also lists every instance globally for its static helpers, which megarl does
        # not use; dropping the list keeps finished models collectable.
        RouterReplay.clear_global_router_replay_instances()
        self.recorded: Dict[int, List[torch.Tensor]] = {}
        self.replaying: Optional[torch.Tensor] = None
        self.recording = False

    def _all(self):
        return [r for routers in self.routers.values() for r in routers]

    def _set(self, action, record_used: bool) -> None:
        for _, router in self._all():
            router.router_replay.router_replay_action = action
            router.router_replay.record_used = record_used

    def _chunk_routers(self, chunk):
        return self.routers.get(id(_unwrapped(chunk)), [])

    def begin(self, replay: Optional[torch.Tensor], record: bool) -> None:
        """Route the coming forwards through `replay` [N, L, layers, k] (None: the routers' own
        choice), and record what they use when `record`."""
        self.replaying, self.recording = replay, record
        self.recorded = {layer: [] for layer, _ in self._all()} if record else {}
        self._set(RouterReplayAction.REPLAY_FORWARD if replay is not None else
                  RouterReplayAction.RECORD if record else None, record)

    def around(self, chunk, mb: PackedMicroBatch, forward):
        if self.replaying is not None:
            self._set_targets(chunk, mb)
        output = forward()
        if self.recording:
            self._collect(chunk, mb)
        return output

    def _set_targets(self, chunk, mb: PackedMicroBatch) -> None:
        tp, tp_rank = megatron_groups.tensor().size, megatron_groups.tensor().rank
        rows = self.replaying[mb.rows][:, :mb.width]  # [n, W, layers, k]
        for layer, router in self._chunk_routers(chunk):
            packed = replay_targets(rows[:, :, layer], mb, layer, self.topk)
            if chunk.config.sequence_parallel:
                packed = packed.chunk(tp)[tp_rank]
            router.router_replay.target_topk_idx = packed.long().to(
                next(chunk.parameters()).device)

    def _collect(self, chunk, mb: PackedMicroBatch) -> None:
        for layer, router in self._chunk_routers(chunk):
            local = router.router_replay.recorded_topk_idx.to(torch.int32)  # [t/cp/tp, k]
            if chunk.config.sequence_parallel:
                group = megatron_groups.tensor().group
                gathered = local.new_empty(local.shape[0] * dist.get_world_size(group), local.shape[1])
                dist.all_gather_into_tensor(gathered, local.contiguous(), group=group)
                local = gathered  # [t/cp, k]
            self.recorded[layer].append(unpack_tokens(full_pack(local, mb).cpu(), mb, -1))

    def end(self, micro_batches: List[PackedMicroBatch], size: int,
            width: int) -> Optional[torch.Tensor]:
        """Stops; what the routers used [N, L, layers, k] on every rank when recording (a
        collective then), else None."""
        recording, recorded = self.recording, self.recorded
        self.abort()
        if not recording:
            return None
        device = megatron_groups.device()
        # Stored + 1 so that an all-reduce of zeros elsewhere leaves -1 where nothing was routed.
        out = torch.zeros(size, width, self.num_layers, self.topk, dtype=torch.int32, device=device)
        if megatron_groups.tensor().rank == 0 and megatron_groups.context().rank == 0:
            for layer, per_mb in recorded.items():
                for rows, mb in zip(per_mb, micro_batches):
                    out[mb.rows.to(device), :rows.shape[1], layer] = (rows + 1).to(device)
        dist.all_reduce(out)
        return (out - 1).cpu()

    def abort(self) -> None:
        """Stops without a collective (a forward failed)."""
        self._set(None, False)
        self.replaying, self.recording = None, False
