"""LoRA adapters on megarl's Megatron models: y = base(x) + scaling * B(A(dropout(x))).

Targets are module kinds (KINDS: each a Megatron linear with a parallel style), HF projection names
(q_proj, up_proj: as PEFT's target_modules) or one projection of one kind (KIND.PROJECTION). Each
HF projection a linear fuses (q, k, v in linear_qkv; gate and up in linear_fc1) has an adapter of
its own, as in PEFT, with its own rank and alpha, or none: a projection without one has no
parameters, and its rows of the fused output get no LoRA term (zeros). Adapters respect the
layout:
- column-parallel base (output split over TP): A [r, in] whole on every TP rank, B [out/tp, r]
  cut as the base's rows. The r-wide activation is gathered (sequence parallel: along the
  sequence, its gradient reduce-scattered) so each rank's B sees every token.
- row-parallel base (input split over TP): A [r, in/tp] cut as the base's columns, B [out, r]
  whole; the partial r-wide products are summed over TP (sequence parallel: reduce-scattered).
- experts: adapters beside each local expert (EP-local), reduced over the expert data-parallel
  group as the expert's own weights are.
A whole tensor that sees only this rank's share of the tokens (sequence parallel) gets a partial
gradient; it carries Megatron's `sequence_parallel` mark so finalize_model_grads sums it over TP,
as it does for the norms. The adapter is a child module `lora` of the base linear, added to its
output by a forward hook, so the base's parameter names (checkpoints, sync) do not change (the
adapters' own names hold ".lora.": param_layout.is_adapter).

Initialization is PEFT's (A Kaiming-uniform, B zero), drawn per adapter from a generator seeded by
its HF name, on the whole tensor before the cut: every layout starts from the same adapters.
"""

import functools
import math
import os
import re
import zlib
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from megatron.core import tensor_parallel
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)

from megarl.models.hf.config import ModelArch
from megarl.models.megatron.param_layout import canonical_name
from megarl.models.weights import transforms as wt
from megarl.models.weights.tables import TABLES, entry_for, rows
from megarl.parallel_state import megatron_groups


@dataclass(frozen=True)
class Kind:
    pattern: str  # the module's name after "decoder.layers.N."
    style: str    # column | row | replicated (a whole linear on every TP rank)
    expert: str = ""  # routed experts: the HF parameter of `mlp.experts` the adapter stands for


# Families whose layers LoRA does not cover yet.
NO_LORA_YET = ("gpt_oss", "qwen3_next", "qwen3_5_moe")
KINDS: Dict[str, Kind] = {
    "attention_qkv": Kind(r"self_attention\.linear_qkv", "column"),
    "attention_proj": Kind(r"self_attention\.linear_proj", "row"),
    "mlp_fc1": Kind(r"mlp\.linear_fc1", "column"),
    "mlp_fc2": Kind(r"mlp\.linear_fc2", "row"),
    "expert_fc1": Kind(r"mlp\.experts\.local_experts\.\d+\.linear_fc1", "column", "gate_up_proj"),
    "expert_fc2": Kind(r"mlp\.experts\.local_experts\.\d+\.linear_fc2", "row", "down_proj"),
    "shared_expert_fc1": Kind(r"mlp\.shared_experts\.linear_fc1", "column"),
    "shared_expert_fc2": Kind(r"mlp\.shared_experts\.linear_fc2", "row"),
    "mla_q": Kind(r"self_attention\.linear_q_proj", "column"),
    "mla_q_down": Kind(r"self_attention\.linear_q_down_proj", "replicated"),
    "mla_q_up": Kind(r"self_attention\.linear_q_up_proj", "column"),
    "mla_kv_down": Kind(r"self_attention\.linear_kv_down_proj", "replicated"),
    "mla_kv_up": Kind(r"self_attention\.linear_kv_up_proj", "column"),
}
# The HF expert module's parameters in the order it registers them: PEFT wraps them in this
# order, the first innermost (its adapter's name gains one "base_layer." per later one).
EXPERT_ORDER = ("expert_fc1", "expert_fc2")
# "all": every kind the model has (PEFT's "all-linear", less the embeddings and the head).
ALL = "all"


@dataclass(frozen=True)
class LoraConfig:
    rank: int = 0  # 0: no adapters (full fine-tuning)
    alpha: float = 16.0
    dropout: float = 0.0
    # "all", module kinds (every projection of the kind's linear), HF projection names (that
    # projection of every linear but the routed experts that has it, as PEFT's target_modules:
    # up_proj adapts the MLP's and the shared experts'), or KIND.PROJECTION (shared_expert_fc1.up_proj)
    targets: Tuple[str, ...] = (ALL,)
    rslora: bool = False  # scaling alpha / sqrt(rank) instead of alpha / rank (PEFT's use_rslora)
    # {key: rank}, {key: alpha} where adapters differ from rank and alpha (PEFT's rank_pattern and
    # alpha_pattern; PEFT itself gives the fused experts' gate_up 2 * rank and 2 * alpha when
    # gate_proj and up_proj are its targets). A key is named as in targets; the most specific
    # wins: KIND.PROJECTION, then the projection's name, then the kind
    kind_ranks: Dict[str, int] = field(default_factory=dict)
    kind_alphas: Dict[str, float] = field(default_factory=dict)
    # a PEFT folder (adapter_config.json, adapter_model.safetensors) the adapters start from: its
    # rank, alpha and targets are the run's (rank may repeat them; 0 takes the folder's)
    init: Optional[str] = None

    def __post_init__(self):
        object.__setattr__(self, "targets", tuple(self.targets))
        if self.init and not os.path.isfile(os.path.join(self.init, "adapter_config.json")):
            raise ValueError(f"lora.init={self.init!r} is not a PEFT adapter folder (no "
                             "adapter_config.json); give the folder PEFT's save_pretrained wrote")
        if self.rank < 0:
            raise ValueError(f"lora.rank={self.rank} must be >= 0 (0: no adapters)")
        if not 0 <= self.dropout < 1:
            raise ValueError(f"lora.dropout={self.dropout} must be in [0, 1)")
        unknown = [t for t in self.targets if t != ALL and not _known_target(t)]
        if unknown or not self.targets:
            raise ValueError(f"lora.targets={list(self.targets)}: {unknown or 'empty'}; choose "
                             f"'{ALL}', module kinds from {sorted(KINDS)}, HF projections from "
                             f"{sorted(_projection_names())} or KIND.PROJECTION")
        for field_name, table in (("kind_ranks", self.kind_ranks), ("kind_alphas", self.kind_alphas)):
            unknown = [key for key in table if not _known_target(key)]
            if unknown:
                raise ValueError(f"lora.{field_name}: {unknown} name no module kind, HF projection or "
                                 "KIND.PROJECTION (as lora.targets)")
        bad = {key: r for key, r in self.kind_ranks.items() if not (isinstance(r, int) and r > 0)}
        if bad:
            raise ValueError(f"lora.kind_ranks={bad}: a rank must be an integer >= 1")

    def _lookup(self, table: Dict[str, float], kind: str, projection: Optional[str]):
        """The most specific key's value: KIND.PROJECTION, the projection's name (not for routed
        experts, which PEFT's target_modules do not name), the kind; None without one."""
        keys = ([f"{kind}.{projection}"] if projection else []) + (
            [projection] if projection and not KINDS[kind].expert else []) + [kind]
        return next((table[key] for key in keys if key in table), None)

    def rank_of(self, kind: str, projection: Optional[str] = None) -> int:
        found = self._lookup(self.kind_ranks, kind, projection)
        return self.rank if found is None else found

    def alpha_of(self, kind: str, projection: Optional[str] = None) -> float:
        found = self._lookup(self.kind_alphas, kind, projection)
        return self.alpha if found is None else found

    def scaling_of(self, kind: str, projection: Optional[str] = None) -> float:
        rank = self.rank_of(kind, projection)
        return self.alpha_of(kind, projection) / (math.sqrt(rank) if self.rslora else rank)


class LoraAdapter(torch.nn.Module):
    """The adapters of one Megatron linear: one (A, B) per adapted HF projection it fuses (`parts`,
    some or all of `projections`: {short name: HF module} in the linear's row order), in
    ParameterDicts keyed by the short name (q_proj, gate_proj, ...; `hf_names` gives each adapted
    one's HF module), each with its own rank and scaling. A routed expert's adapter stands for its
    slice of PEFT's adapter on the layer's fused expert parameter (`expert`: (global expert id, that
    parameter's nesting depth among the layer's adapted expert parameters), see
    models/lora/peft_io.py)."""

    def __init__(self, config: LoraConfig, kind_name: str, base: torch.nn.Module, projections: Dict[str, str],
                 parts: Sequence[str], transform: str, arch: ModelArch, sequence_parallel: bool,
                 expert: Optional[Tuple[int, int]] = None):
        super().__init__()
        kind = KINDS[kind_name]
        self.expert = expert
        self.style, self.transform, self.arch = kind.style, transform, arch
        self.projections = tuple(projections)
        self.hf_names = {short: projections[short] for short in self.projections if short in parts}
        self.ranks = {short: config.rank_of(kind_name, short) for short in self.hf_names}
        self.scalings = {short: config.scaling_of(kind_name, short) for short in self.hf_names}
        self.dropout = torch.nn.Dropout(config.dropout) if config.dropout else torch.nn.Identity()
        group = megatron_groups.expert_tensor() if kind.expert else megatron_groups.tensor()
        self.tp_rank, self.tp_size = group.rank, group.size
        self.sequence_parallel = sequence_parallel and not kind.expert and self.tp_size > 1
        self.A, self.B = torch.nn.ParameterDict(), torch.nn.ParameterDict()
        shapes = dict(zip(self.projections, full_shapes(self.style, transform, arch, len(self.projections),
                                                         tuple(base.weight.shape), self.tp_size)))
        for short, hf in self.hf_names.items():
            out_full, in_full = shapes[short]
            a, b = _peft_init(f"{hf}.{short}.{expert}", self.ranks[short], out_full, in_full,
                              base.weight.is_meta)
            # in the base's dtype: a bf16 model's optimizer keeps fp32 main copies of both
            self.A[short] = torch.nn.Parameter(self.local(a, "A").to(base.weight.dtype))
            self.B[short] = torch.nn.Parameter(self.local(b, "B").to(base.weight.dtype))
        for which, params in (("A", self.A), ("B", self.B)):
            for param in params.values():
                self._mark(param, self.split_dim(which), kind, base)

    def split_dim(self, which: str) -> Optional[int]:
        """The dimension this rank's piece of A or B is cut along (None: whole)."""
        return split_dim(self.style, which, self.tp_size)

    def local(self, full: torch.Tensor, which: str) -> torch.Tensor:
        """This rank's piece of a whole A or B."""
        dim = self.split_dim(which)
        return full if dim is None else full.chunk(self.tp_size, dim)[self.tp_rank].clone()

    def _mark(self, param: torch.nn.Parameter, split: Optional[int], kind: Kind,
              base: torch.nn.Module) -> None:
        if split is not None:
            tensor_parallel.set_tensor_model_parallel_attributes(param, True, split, 1)
        elif self.sequence_parallel:
            param.sequence_parallel = True  # a partial gradient: finalize_model_grads sums it
        if kind.expert:  # reduced over the expert data-parallel group, as the expert is
            param.allreduce = getattr(base.weight, "allreduce", True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.dropout(x)
        z = torch.cat([x @ a.t() for a in self.A.values()], dim=-1)  # [..., sum of the parts' ranks]
        if self.tp_size > 1 and self.style == "column":
            z = (gather_from_sequence_parallel_region(z) if self.sequence_parallel
                 else copy_to_tensor_model_parallel_region(z))
        elif self.tp_size > 1 and self.style == "row":
            z = (reduce_scatter_to_sequence_parallel_region(z) if self.sequence_parallel
                 else reduce_from_tensor_model_parallel_region(z))
        pieces = {short: (zp @ b.t() * self.scalings[short]).movedim(-1, 0) for (short, b), zp in
                  zip(self.B.items(), z.split(list(self.ranks.values()), dim=-1))}
        return self._fuse(pieces).movedim(0, -1)

    def _fuse(self, pieces: Dict[str, torch.Tensor]) -> torch.Tensor:
        return fuse_rows(self.transform, self.arch, [pieces.get(short) for short in self.projections],
                         self.tp_size)

    def delta_weight(self) -> torch.Tensor:
        """scaling * B @ A in the base weight's local layout, for merging into it."""
        return self._fuse({short: (self.B[short] @ self.A[short]) * self.scalings[short]
                           for short in self.hf_names})


def fuse_rows(transform: str, arch: ModelArch, pieces: List[Optional[torch.Tensor]],
              tp_size: int = 1) -> torch.Tensor:
    """The HF projections' rows (dimension 0) in their Megatron linear's row order, on one TP rank
    of `tp_size` (1: the whole linear): weight_transforms' merge. A projection without an adapter
    (None) gets zero rows: q's, k's or v's height, or its sibling's (gate and up are as tall)."""
    present = next(p for p in pieces if p is not None)
    if transform == "qkv":
        heads, kv_heads = arch.num_heads // tp_size, arch.num_kv_heads // tp_size
        heights = [heads * arch.head_dim, kv_heads * arch.head_dim, kv_heads * arch.head_dim]
    else:
        heights = [present.shape[0]] * len(pieces)
    pieces = [p if p is not None else present.new_zeros((h, *present.shape[1:]))
              for p, h in zip(pieces, heights)]
    if transform == "qkv":
        return wt.merge_qkv(*pieces, heads, kv_heads, arch.head_dim)
    return torch.cat(pieces, dim=0)


def expert_of(canonical: str) -> Tuple[str, int]:
    """(the HF module of the layer's fused experts, the global expert id) of a routed expert's
    canonical weight: the PEFT module its adapter is a slice of."""
    layer, expert = map(int, re.findall(r"\.(\d+)\.", canonical)[:2])
    return f"model.layers.{layer}.mlp.experts", expert


def expert_nesting(kinds: Dict[str, Kind], kind: str) -> int:
    """How deep PEFT nests a routed expert kind's adapter: one "base_layer." per adapted expert
    parameter the HF module registers after it."""
    return len([k for k in EXPERT_ORDER[EXPERT_ORDER.index(kind) + 1:] if k in kinds])


def full_shapes(style: str, transform: str, arch: ModelArch, parts: int, local: Tuple[int, int],
                tp_size: int) -> List[Tuple[int, int]]:
    """(out, in) of each HF projection a base linear of `style` fuses (`parts` of them, joined by
    `transform`), from the base's local weight shape and the TP size."""
    out_local, in_local = local
    if style == "replicated":
        return [(out_local, in_local)]
    if style == "row":
        return [(out_local, in_local * tp_size)]
    if transform == "qkv":
        q, kv = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
        return [(q, in_local), (kv, in_local), (kv, in_local)]
    return [(out_local // parts * tp_size, in_local)] * parts


def split_dim(style: str, which: str, tp_size: int) -> Optional[int]:
    """The dimension a TP rank's piece of A [r, in] or B [out, r] is cut along (None: whole): a
    column-parallel base cuts B's rows, a row-parallel one A's columns."""
    if tp_size == 1:
        return None
    return {("column", "B"): 0, ("row", "A"): 1}.get((style, which))


def kind_of(kinds: Dict[str, Kind], canonical: str) -> Optional[str]:
    """Which of `kinds` the linear whose weight is `canonical` is (None: none of them)."""
    return next((k for k in kinds if _matches(kinds[k], canonical, r"\d+")), None)


def _peft_init(hf_name: str, rank: int, out_full: int, in_full: int, meta: bool = False):
    if meta:  # a model built to be counted (models/memory/held_params.py): shapes only
        return torch.empty(rank, in_full, device="meta"), torch.empty(out_full, rank, device="meta")
    generator = torch.Generator().manual_seed(zlib.crc32(hf_name.encode()))
    a = torch.empty(rank, in_full)
    bound = 1 / math.sqrt(in_full)  # kaiming_uniform_(a=sqrt(5)) on [r, in], as nn.Linear and PEFT
    a.uniform_(-bound, bound, generator=generator)
    return a, torch.zeros(out_full, rank)


def _add_delta(module, args, output):
    out, bias = output
    return out + module.lora(args[0]).to(out.dtype), bias


_EXPERT_ID = r"(?:\d+|\{expert\})"


def _matches(kind: Kind, name: str, layer: str) -> bool:
    """Whether `name` (a module, or a weight table's template with .weight) is of this kind."""
    pattern = kind.pattern.replace(r"\d+", _EXPERT_ID)
    return re.fullmatch(rf"decoder\.layers\.{layer}\.{pattern}(?:\.weight)?", name) is not None


def kinds_of(arch: ModelArch) -> List[str]:
    """The module kinds this model has, from its weight table."""
    return [name for name, kind in KINDS.items()
            if any(_matches(kind, row.megatron, r"\{layer\}") for row in rows(arch))]


def projections(arch: ModelArch, kind: str) -> Tuple[str, ...]:
    """The HF projections (last name part: q_proj, gate_proj, ...) a kind's linear fuses, in its row
    order: PEFT's target_modules; for routed experts, the parameter of `mlp.experts` (PEFT's
    target_parameters)."""
    if KINDS[kind].expert:
        return (KINDS[kind].expert,)
    return next((tuple(hf.rsplit(".", 2)[-2] for hf in row.hf) for row in rows(arch)
                 if _matches(KINDS[kind], row.megatron, r"\{layer\}")), ())


@functools.lru_cache(maxsize=None)
def _known_projections() -> Dict[str, frozenset]:
    """{kind: every projection its linear fuses in any family's weight table}."""
    known = {name: set([kind.expert] if kind.expert else []) for name, kind in KINDS.items()}
    for table in TABLES.values():
        for row in table:
            for name, kind in KINDS.items():
                if not kind.expert and _matches(kind, row.megatron, r"\{layer\}"):
                    known[name].update(hf.rsplit(".", 2)[-2] for hf in row.hf)
    return {name: frozenset(shorts) for name, shorts in known.items()}


def _projection_names() -> set:
    """The HF projection names lora.targets takes (PEFT's target_modules: not the routed experts')."""
    return {short for name, shorts in _known_projections().items() if not KINDS[name].expert
            for short in shorts}


def _known_target(name: str) -> bool:
    """Whether `name` is a kind, an HF projection name, or KIND.PROJECTION of some family."""
    kind, _, short = name.partition(".")
    return name in KINDS or name in _projection_names() or short in _known_projections().get(kind, ())


def chosen_parts(arch: ModelArch, config: LoraConfig) -> Dict[str, Tuple[str, ...]]:
    """{kind: the projections adapted in its linear, in row order} of what `config.targets` names
    on this model, or a ValueError naming the targets it lacks."""
    if arch.family in NO_LORA_YET:
        # Their new layers (sinks and biased fused experts; linear attention and gated q) have no
        # adapter layout, PEFT mapping or engine merge yet: refused rather than half adapted.
        raise ValueError(f"actor.lora: LoRA is not supported yet for the {arch.family} family; "
                         "set actor.lora.rank=0 (full fine-tuning)")
    present = kinds_of(arch)
    wanted: Dict[str, set] = {}
    missing = []
    for target in config.targets:
        kind, _, short = target.partition(".")
        if target == ALL or target in KINDS:
            chosen = {k: set(projections(arch, k)) for k in present if target in (ALL, k)}
        elif short:
            chosen = {kind: {short}} if kind in present and short in projections(arch, kind) else {}
        else:  # an HF projection name: that projection of every linear that has it (not the experts')
            chosen = {k: {target} for k in present if not KINDS[k].expert and target in projections(arch, k)}
        if not chosen:
            missing.append(target)
        for k, shorts in chosen.items():
            wanted.setdefault(k, set()).update(shorts)
    if missing:
        names = sorted({p for k in present if not KINDS[k].expert for p in projections(arch, k)})
        raise ValueError(f"lora.targets {missing}: {arch.family} has no such modules; its kinds: "
                         f"{present} (or '{ALL}'), its projections: {names}")
    return {k: tuple(p for p in projections(arch, k) if p in wanted[k]) for k in present if k in wanted}


def chosen_kinds(arch: ModelArch, config: LoraConfig) -> Dict[str, Kind]:
    """The kinds with at least one adapted projection (chosen_parts)."""
    return {name: KINDS[name] for name in chosen_parts(arch, config)}


def attach(chunks: List[torch.nn.Module], arch: ModelArch, config: LoraConfig) -> None:
    """Adapters on every target module of this rank's chunks, and every other parameter frozen
    (no gradient: Megatron's DDP gives it no buffer and the optimizer no state). Call before DDP
    and the optimizer are built."""
    from megarl.platform.device_choice import uses_transformer_engine

    parts = chosen_parts(arch, config)
    kinds = {name: KINDS[name] for name in parts}
    if uses_transformer_engine():
        raise ValueError("LoRA adapts Megatron's local linear layers; Transformer Engine's fuse the "
                         "norm into the projection whose input the adapter needs: set "
                         "model.transformer_engine=false for a LoRA run")
    if megatron_groups.expert_tensor().size > 1 and any(k.expert for k in kinds.values()):
        raise ValueError("LoRA on experts needs expert TP 1 (layout.etp=1); or leave the expert "
                         "kinds out of lora.targets")
    for chunk in chunks:
        for param in chunk.parameters():
            param.requires_grad_(False)
    for chunk in chunks:
        for name, module in list(chunk.named_modules()):
            kind = kind_of(kinds, name)
            if kind is None:
                continue
            canonical = canonical_name(chunk, name + ".weight")
            entry = entry_for(arch, canonical)
            if kinds[kind].expert:
                module_name, expert = expert_of(canonical)
                module.lora = LoraAdapter(config, kind, module, {kinds[kind].expert: module_name},
                                          parts[kind], "copy", arch, chunk.config.sequence_parallel,
                                          (expert, expert_nesting(kinds, kind)))
            else:
                names = {hf.rsplit(".", 2)[-2]: hf[:-len(".weight")] for hf in entry.hf}
                module.lora = LoraAdapter(config, kind, module, names, parts[kind], entry.transform,
                                          arch, chunk.config.sequence_parallel)
            module.register_forward_hook(_add_delta)


class MergedWeight:
    """An adapted linear's weight with its adapters merged in, W + scaling * B @ A, computed anew
    from the frozen W each time it is read: the weight sync and the HF export send it (a piece at
    a time: narrow) and W itself never changes, so repeated merges cannot drift."""

    def __init__(self, weight: torch.nn.Parameter, adapter: "LoraAdapter"):
        self.weight, self.adapter = weight, adapter
        self.shape, self.dtype = weight.shape, weight.dtype

    @torch.no_grad()
    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        merged = self.weight.detach().float() + self.adapter.delta_weight().float()
        return merged.to(self.dtype).narrow(dim, start, length)


def merged_weights(chunks: List[torch.nn.Module]) -> Dict[int, MergedWeight]:
    """{id(weight): MergedWeight} of every adapted linear of this rank's chunks."""
    return {id(m.weight): MergedWeight(m.weight, m.lora) for chunk in chunks for m in chunk.modules()
            if isinstance(getattr(m, "lora", None), LoraAdapter)}


def adapters(chunks: List[torch.nn.Module]) -> List[LoraAdapter]:
    """This rank's adapters, in module order."""
    return [m for chunk in chunks for m in chunk.modules() if isinstance(m, LoraAdapter)]
