"""The token counts behind the aux-loss-free expert bias (DeepSeek-V3's balancing, which
Megatron-Core updates in finalize_model_grads from each router's `local_tokens_per_expert`),
counted over real tokens only.

A pack's padding (to multiples of TP and CP) differs between layouts, and padding tokens get
routed like any other: counted, they would move the bias differently at TP2 than on one rank.
Megatron-Core 0.16's own `padding_mask` cannot be used for this: its `_apply_expert_bias` does
not broadcast the flattened mask over the experts, and its aux-loss functions disagree on which
value marks padding. So megarl counts itself: the routers' counting is replaced by one that
drops the positions `set_padding` marked for the micro-batch about to run.
"""

import types
from typing import List

import torch
from megatron.core.transformer.moe.router import TopKRouter


def _count_real_tokens(router: TopKRouter, routing_map: torch.Tensor, padding_mask=None) -> None:
    if router.enable_expert_bias and torch.is_grad_enabled():
        with torch.no_grad():
            padding = router.megarl_padding
            if padding is not None:
                routing_map = routing_map & ~padding.reshape(-1, 1)
            router.local_tokens_per_expert += routing_map.sum(dim=0)


def _biased_routers(chunk: torch.nn.Module) -> List[TopKRouter]:
    if not hasattr(chunk, "_megarl_biased_routers"):
        routers = [m for m in chunk.modules() if isinstance(m, TopKRouter) and m.enable_expert_bias]
        for router in routers:
            router.megarl_padding = None
            router._apply_expert_bias = types.MethodType(_count_real_tokens, router)
        chunk._megarl_biased_routers = routers
    return chunk._megarl_biased_routers


def set_padding(chunk: torch.nn.Module, padding: torch.Tensor) -> None:
    """Before a forward of `chunk`: `padding` [tokens this rank's routers see] is True at the
    pack's padding positions, which then count toward no expert's load."""
    for router in _biased_routers(chunk):
        router.megarl_padding = padding
