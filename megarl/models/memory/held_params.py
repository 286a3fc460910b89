"""The parameters one rank of a training layout holds, from megarl's own model built on the meta
device: no weights, no memory, a giant model's stage in about a second.

Owns counting them, split by how the optimizer shards them: dense parameters over the
data-parallel (x context-parallel) group, experts' over the expert-data-parallel group (Megatron
marks them allreduce=False). Everything else a rank holds is sized from these counts
(planning/memory_plan.py). Does not own the build (builder.build_model) or the process groups
(megatron_groups.fake_world).
"""

import functools
import warnings
from dataclasses import dataclass
from typing import Dict, List, Optional

from megarl.models.hf.config import ModelArch
from megarl.models.lora.adapters import LoraConfig, attach
from megarl.models.megatron.builder import build_model
from megarl.models.megatron.param_layout import WEIGHT_BUFFERS
from megarl.parallel_state import megatron_groups
from megarl.parallel_state.dims import ParallelDims


@dataclass(frozen=True)
class HeldParams:
    dense: int  # trained elements whose gradients are reduced over DP x CP
    expert: int  # trained elements whose gradients are reduced over expert-DP
    buffers: int  # elements of weight buffers (the fp32 router expert bias): no gradient
    bytes: int  # the parameters' and weight buffers' own bytes (each in its dtype), frozen ones too
    frozen: int = 0  # parameters' elements without gradient or optimizer state (a LoRA run's base)
    largest: int = 0  # the largest trained parameter's elements (a step's per-tensor temporaries)

    @property
    def elements(self) -> int:
        return self.dense + self.expert


def stage_ranks(dims: ParallelDims) -> List[int]:
    """The first rank of each pipeline stage: Megatron's rank order puts the stage outermost, so
    every rank of a stage holds the same parameter counts (even TP and EP splits)."""
    per_stage = dims.world_size // dims.pp
    return [stage * per_stage for stage in range(dims.pp)]


def held_params(arch: ModelArch, dims: ParallelDims, role: str = "policy", lora: Optional[LoraConfig] = None,
                **config_overrides) -> Dict[int, HeldParams]:
    """{pipeline stage: what each of its ranks holds} of `arch` at `dims`, built by build_model
    on the meta device as each stage's first rank, with `lora`'s adapters attached as a LoRA run
    attaches them (lora.attach: only they train). Not inside a running job (fake_world).
    Remembered per arguments: a plan asks again for what preflight, a preset's plans and the
    planners' scripts asked already, and a giant layout's fake worlds (every group of a world of
    hundreds of ranks, per stage) cost seconds each."""
    key = (arch, dims, role, lora, tuple(sorted(config_overrides.items())))
    try:
        hash(key)
    except TypeError:  # a LoRA config's per-module dicts: built again, as before
        return _build_held_params(*key)
    return dict(_remembered(*key))


@functools.lru_cache(maxsize=64)
def _remembered(*key) -> Dict[int, HeldParams]:
    return _build_held_params(*key)


def _build_held_params(arch: ModelArch, dims: ParallelDims, role: str, lora: Optional[LoraConfig],
                 config_overrides: tuple) -> Dict[int, HeldParams]:
    held = {}
    for stage, rank in enumerate(stage_ranks(dims)):
        with megatron_groups.fake_world(dims, rank), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # Megatron's notes on running the config
            chunks = build_model(arch, dims, role=role, meta=True, **dict(config_overrides))
            if lora is not None:
                attach(chunks, arch, lora)
            params = [p for chunk in chunks for p in chunk.parameters()]
            trained = [p for p in params if p.requires_grad]
            buffers = [b for chunk in chunks for name, b in chunk.named_buffers()
                       if WEIGHT_BUFFERS.search(name)]
            expert = sum(p.numel() for p in trained if not getattr(p, "allreduce", True))
            total = sum(p.numel() for p in trained)
            held[stage] = HeldParams(dense=total - expert, expert=expert,
                                     buffers=sum(b.numel() for b in buffers),
                                     bytes=sum(t.numel() * t.element_size() for t in params + buffers),
                                     frozen=sum(p.numel() for p in params) - total,
                                     largest=max((p.numel() for p in trained), default=0))
    return held
