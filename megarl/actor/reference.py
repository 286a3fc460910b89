"""The reference policy as a weight set, not a second model.

Owns a host copy of this rank's trained parameter shards (with LoRA: the adapters only) and
expert-bias buffers (pinned on GPU machines) and swapping it into the actor's own modules for a
forward, then restoring the actor's weights bit for bit. Memory on the accelerator: nothing beyond
the actor; on the host: one copy of those shards.
Does not own computing log-probs (actor.py).
"""

import contextlib
from typing import Dict, List

import torch

from megarl.models.megatron.param_layout import WEIGHT_BUFFERS
from megarl.platform import device_choice


def _named_parameters(chunks: List[torch.nn.Module]) -> Dict[str, torch.Tensor]:
    """The parameters training changes (a frozen one, as LoRA's base, stays the reference's) and
    the weight buffers: the reference routes with its own expert bias."""
    named = {}
    for i, chunk in enumerate(chunks):
        named.update({f"{i}.{name}": p for name, p in chunk.named_parameters() if p.requires_grad})
        named.update({f"{i}.{name}": b for name, b in chunk.named_buffers() if WEIGHT_BUFFERS.search(name)})
    return named


def _host_copy(tensor: torch.Tensor) -> torch.Tensor:
    copy = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu",
                       pin_memory=device_choice.on_gpu())
    return copy.copy_(tensor.detach())


class ReferenceWeights:
    def __init__(self, chunks: List[torch.nn.Module]):
        self.weights = {name: _host_copy(p) for name, p in _named_parameters(chunks).items()}

    @contextlib.contextmanager
    def swapped_in(self, chunks: List[torch.nn.Module]):
        """Within the block `chunks` hold the reference weights; the actor's are restored after."""
        params = _named_parameters(chunks)
        if params.keys() != self.weights.keys():
            raise ValueError("the reference weights were taken from a different model layout: "
                             f"{sorted(params.keys() ^ self.weights.keys())[:5]} differ")
        current = {name: _host_copy(p) for name, p in params.items()}
        with torch.no_grad():
            for name, p in params.items():
                p.copy_(self.weights[name], non_blocking=True)
            try:
                yield
            finally:
                for name, p in params.items():
                    p.copy_(current[name], non_blocking=True)
