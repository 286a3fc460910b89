"""What LoRA adds to a base weight, scaling * B @ A, for one full canonical Megatron tensor, from
whole PEFT tensors (peft_io names): for a destination that holds the unmerged base and merges the
adapters itself (a vLLM engine without LoRA slots: rollout/vllm/merge.py). The trainer's own merge
(lora.MergedWeight) is the same sum on its TP shard, fused the same way (lora.fuse_rows: a
projection without an adapter adds zero rows).
"""

from typing import Dict

import torch

from megarl.models.hf.config import ModelArch
from megarl.models.lora.adapters import (
    KINDS,
    LoraConfig,
    chosen_parts,
    expert_nesting,
    expert_of,
    fuse_rows,
    kind_of,
)
from megarl.models.lora.peft_io import expert_slice, peft_key
from megarl.models.weights.tables import entry_for


class Deltas:
    """The deltas of one model's adapters (`config`) from one version's PEFT tensors."""

    def __init__(self, arch: ModelArch, config: LoraConfig, tensors: Dict[str, torch.Tensor]):
        self.arch, self.config, self.tensors = arch, config, tensors
        self.parts = chosen_parts(arch, config)
        self.kinds = {kind: KINDS[kind] for kind in self.parts}

    @torch.no_grad()
    def full(self, canonical: str) -> torch.Tensor:
        """scaling * B @ A of `canonical`'s adapters, whole, in float32 and Megatron's row order."""
        kind = kind_of(self.kinds, canonical)
        if kind is None:
            raise KeyError(f"{canonical} has no adapter (lora.targets: {list(self.config.targets)})")
        if KINDS[kind].expert:
            scaling = self.config.scaling_of(kind, KINDS[kind].expert)
            module, expert = expert_of(canonical)
            nest = expert_nesting(self.kinds, kind)
            a = expert_slice(self._tensor(peft_key(module, "A", nest)), "A", expert, self.arch.num_experts)
            b = expert_slice(self._tensor(peft_key(module, "B", nest)), "B", expert, self.arch.num_experts)
            return (b.float() @ a.float()) * scaling
        entry = entry_for(self.arch, canonical)
        pieces = []
        for hf in entry.hf:
            module, short = hf[:-len(".weight")], hf.rsplit(".", 2)[-2]
            if short not in self.parts[kind]:
                pieces.append(None)  # no adapter: zero rows
                continue
            a, b = self._tensor(peft_key(module, "A")), self._tensor(peft_key(module, "B"))
            pieces.append((b.float() @ a.float()) * self.config.scaling_of(kind, short))
        return fuse_rows(entry.transform, self.arch, pieces)

    def _tensor(self, key: str) -> torch.Tensor:
        if key not in self.tensors:
            raise KeyError(f"the adapters sent lack {key}: the engine and the actor were built with "
                           "different lora settings")
        return self.tensors[key]
