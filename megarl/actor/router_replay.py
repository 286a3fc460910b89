"""MoE router replay: record each token's top-k experts while computing old log-probs, and route
the update's forwards through exactly those experts, so the update starts from the policy that
produced `old_logprobs` even where a router's top-k is a near tie.

Owns the per-layer recording, storing it in the batch as [N, L, layers, k] (input-token aligned,
-1 where nothing was routed), independent of micro-batching and parallel layout, and setting each
router's targets right before its chunk's forward. Uses Megatron-Core's RouterReplay hooks (the
router calls them in its top-k); megarl attaches one per router and drives it per instance.
Does not own which experts a router picks otherwise.
"""

from typing import Dict, List, Tuple

import torch
import torch.distributed as dist
from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

from megarl.actor.packing import PackedMicroBatch, pack_tokens, unpack_tokens
from megarl.actor.schedule import full_pack
from megarl.parallel_state import megatron_groups


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
                if router.router_replay is None:
                    router.router_replay = RouterReplay()
        if not any(self.routers.values()) and megatron_groups.pipeline().size == 1:
            raise ValueError("router_replay is on but the model has no MoE router; turn it off")
        # Megatron also lists every instance globally for its static helpers, which megarl does
        # not use; dropping the list keeps finished models collectable.
        RouterReplay.clear_global_router_replay_instances()
        self.recorded: Dict[int, List[torch.Tensor]] = {}

    def _all(self):
        return [r for routers in self.routers.values() for r in routers]

    def _set_action(self, action):
        for _, router in self._all():
            router.router_replay.router_replay_action = action

    def _chunk_routers(self, chunk):
        return self.routers.get(id(_unwrapped(chunk)), [])

    def start_recording(self) -> None:
        self.recorded = {layer: [] for layer, _ in self._all()}
        self._set_action(RouterReplayAction.RECORD)

    def record_around(self, chunk, mb: PackedMicroBatch, forward):
        output = forward()
        for layer, router in self._chunk_routers(chunk):
            local = router.router_replay.recorded_topk_idx.to(torch.int32)  # [t/cp/tp, k]
            if chunk.config.sequence_parallel:
                group = megatron_groups.tensor().group
                gathered = local.new_empty(local.shape[0] * dist.get_world_size(group), local.shape[1])
                dist.all_gather_into_tensor(gathered, local.contiguous(), group=group)
                local = gathered  # [t/cp, k]
            self.recorded[layer].append(unpack_tokens(full_pack(local, mb).cpu(), mb, -1))
        return output

    def finish_recording(self, micro_batches: List[PackedMicroBatch], size: int,
                         width: int) -> torch.Tensor:
        """[N, L, layers, k] on every rank; stops recording."""
        self._set_action(None)
        device = megatron_groups.device()
        # Stored + 1 so that an all-reduce of zeros elsewhere leaves -1 where nothing was routed.
        out = torch.zeros(size, width, self.num_layers, self.topk, dtype=torch.int32, device=device)
        if megatron_groups.tensor().rank == 0 and megatron_groups.context().rank == 0:
            for layer, per_mb in self.recorded.items():
                for rows, mb in zip(per_mb, micro_batches):
                    out[mb.rows.to(device), :rows.shape[1], layer] = (rows + 1).to(device)
        dist.all_reduce(out)
        self.recorded = {}
        return (out - 1).cpu()

    def start_replay(self, routed_experts: torch.Tensor) -> None:
        if routed_experts is None:
            raise ValueError("router_replay needs batch.routed_experts: compute old log-probs with "
                             "the same actor first (Actor.logprobs records the routing)")
        self.routed_experts = routed_experts
        self._set_action(RouterReplayAction.REPLAY_FORWARD)

    def replay_around(self, chunk, mb: PackedMicroBatch, forward):
        tp, tp_rank = megatron_groups.tensor().size, megatron_groups.tensor().rank
        rows = self.routed_experts[mb.rows][:, :mb.width]  # [n, W, layers, k]
        for layer, router in self._chunk_routers(chunk):
            packed = pack_tokens(rows[:, :, layer], mb, -1)[mb.local_index]  # [t/cp, k]
            # Padding was never routed: any valid distinct experts do (its loss is masked).
            packed = torch.where(packed < 0, torch.arange(self.topk, dtype=packed.dtype), packed)
            if chunk.config.sequence_parallel:
                packed = packed.chunk(tp)[tp_rank]
            router.router_replay.target_topk_idx = packed.long().to(
                next(chunk.parameters()).device)
        return forward()

    def stop_replay(self) -> None:
        self._set_action(None)
        self.routed_experts = None
