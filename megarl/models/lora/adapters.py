"""LoRA adapters on megarl's Megatron models: y = base(x) + scaling * B(A(dropout(x))).

Targets are module kinds (KINDS), not per-family names: each kind is a Megatron linear with a
parallel style, and each HF projection it fuses (q, k, v in linear_qkv; gate and up in
linear_fc1) gets an adapter of its own, as PEFT gives each HF projection one. Adapters respect
the layout:
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

import math
import os
import re
import zlib
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

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
from megarl.models.weights.tables import entry_for, rows
from megarl.parallel_state import megatron_groups


@dataclass(frozen=True)
class Kind:
    pattern: str  # the module's name after "decoder.layers.N."
    style: str    # column | row | replicated (a whole linear on every TP rank)
    expert: str = ""  # routed experts: the HF parameter of `mlp.experts` the adapter stands for


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
    targets: Tuple[str, ...] = (ALL,)
    rslora: bool = False  # scaling alpha / sqrt(rank) instead of alpha / rank (PEFT's use_rslora)
    # {kind: rank}, {kind: alpha} where a kind's adapters differ from rank and alpha (PEFT's
    # rank_pattern and alpha_pattern; PEFT itself gives the fused experts' gate_up 2 * rank and
    # 2 * alpha when gate_proj and up_proj are its targets)
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
        unknown = [t for t in self.targets if t != ALL and t not in KINDS]
        if unknown or not self.targets:
            raise ValueError(f"lora.targets={list(self.targets)}: {unknown or 'empty'}; choose "
                             f"'{ALL}' or module kinds from {sorted(KINDS)}")

    def rank_of(self, kind: str) -> int:
        return self.kind_ranks.get(kind, self.rank)

    def scaling_of(self, kind: str) -> float:
        rank = self.rank_of(kind)
        return self.kind_alphas.get(kind, self.alpha) / (math.sqrt(rank) if self.rslora else rank)


class LoraAdapter(torch.nn.Module):
    """The adapters of one Megatron linear: one (A, B) per HF projection it fuses, in
    ParameterDicts keyed by that projection's name (q_proj, gate_proj, ...; `hf_names` gives each
    one's HF module). A routed expert's adapter stands for its slice of PEFT's adapter on the
    layer's fused expert parameter (`expert`: (global expert id, that parameter's nesting depth
    among the layer's adapted expert parameters), see models/lora/peft_io.py)."""

    def __init__(self, config: LoraConfig, kind_name: str, base: torch.nn.Module, hf_names: Dict[str, str],
                 transform: str, arch: ModelArch, sequence_parallel: bool,
                 expert: Optional[Tuple[int, int]] = None):
        super().__init__()
        kind = KINDS[kind_name]
        self.expert = expert
        self.style, self.transform, self.arch = kind.style, transform, arch
        self.scaling, self.rank = config.scaling_of(kind_name), config.rank_of(kind_name)
        self.dropout = torch.nn.Dropout(config.dropout) if config.dropout else torch.nn.Identity()
        group = megatron_groups.expert_tensor() if kind.expert else megatron_groups.tensor()
        self.tp_rank, self.tp_size = group.rank, group.size
        self.sequence_parallel = sequence_parallel and not kind.expert and self.tp_size > 1
        self.hf_names = hf_names
        self.A, self.B = torch.nn.ParameterDict(), torch.nn.ParameterDict()
        for (short, hf), (out_full, in_full) in zip(hf_names.items(), self._full_shapes(base)):
            a, b = _peft_init(f"{hf}.{short}.{expert}", self.rank, out_full, in_full, base.weight.is_meta)
            # in the base's dtype: a bf16 model's optimizer keeps fp32 main copies of both
            self.A[short] = torch.nn.Parameter(self.local(a, "A").to(base.weight.dtype))
            self.B[short] = torch.nn.Parameter(self.local(b, "B").to(base.weight.dtype))
        for which, params in (("A", self.A), ("B", self.B)):
            for param in params.values():
                self._mark(param, self.split_dim(which), kind, base)

    def _full_shapes(self, base: torch.nn.Module) -> List[Tuple[int, int]]:
        return full_shapes(self.style, self.transform, self.arch, len(self.hf_names),
                           tuple(base.weight.shape), self.tp_size)

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
        z = torch.cat([x @ a.t() for a in self.A.values()], dim=-1)  # [..., parts * r]
        if self.tp_size > 1 and self.style == "column":
            z = (gather_from_sequence_parallel_region(z) if self.sequence_parallel
                 else copy_to_tensor_model_parallel_region(z))
        elif self.tp_size > 1 and self.style == "row":
            z = (reduce_scatter_to_sequence_parallel_region(z) if self.sequence_parallel
                 else reduce_from_tensor_model_parallel_region(z))
        pieces = [zp @ b.t() for zp, b in zip(z.split(self.rank, dim=-1), self.B.values())]
        return self._fuse([p.movedim(-1, 0) for p in pieces]).movedim(0, -1) * self.scaling

    def _fuse(self, pieces: List[torch.Tensor]) -> torch.Tensor:
        return fuse_rows(self.transform, self.arch, pieces, self.tp_size)

    def delta_weight(self) -> torch.Tensor:
        """scaling * B @ A in the base weight's local layout, for merging into it."""
        return self._fuse([b @ a for a, b in zip(self.A.values(), self.B.values())]) * self.scaling


def fuse_rows(transform: str, arch: ModelArch, pieces: List[torch.Tensor], tp_size: int = 1) -> torch.Tensor:
    """The HF projections' rows (dimension 0) in their Megatron linear's row order, on one TP rank
    of `tp_size` (1: the whole linear): weight_transforms' merge."""
    if transform == "qkv":
        return wt.merge_qkv(*pieces, arch.num_heads // tp_size, arch.num_kv_heads // tp_size, arch.head_dim)
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


def hf_module_names(arch: ModelArch, kind: str) -> set:
    """The HF projections (last name part: q_proj, gate_proj, ...) a kind's adapters stand for: PEFT's
    target_modules; for routed experts, the parameter of `mlp.experts` (PEFT's target_parameters)."""
    if KINDS[kind].expert:
        return {KINDS[kind].expert}
    return {hf.rsplit(".", 2)[-2] for row in rows(arch)
            if _matches(KINDS[kind], row.megatron, r"\{layer\}") for hf in row.hf}


def chosen_kinds(arch: ModelArch, config: LoraConfig) -> Dict[str, Kind]:
    """The kinds `config.targets` names on this model, or a ValueError naming the missing ones."""
    present = kinds_of(arch)
    if ALL in config.targets:
        return {name: KINDS[name] for name in present}
    missing = [t for t in config.targets if t not in present]
    if missing:
        raise ValueError(f"lora.targets {missing}: {arch.family} has no such modules; its kinds: "
                         f"{present} (or '{ALL}')")
    return {name: KINDS[name] for name in config.targets}


def attach(chunks: List[torch.nn.Module], arch: ModelArch, config: LoraConfig) -> None:
    """Adapters on every target module of this rank's chunks, and every other parameter frozen
    (no gradient: Megatron's DDP gives it no buffer and the optimizer no state). Call before DDP
    and the optimizer are built."""
    from megarl.platform.device_choice import uses_transformer_engine

    kinds = chosen_kinds(arch, config)
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
                names = {kinds[kind].expert: module_name}
                module.lora = LoraAdapter(config, kind, module, names, "copy", arch,
                                          chunk.config.sequence_parallel,
                                          (expert, expert_nesting(kinds, kind)))
            else:
                names = {hf.rsplit(".", 2)[-2]: hf[:-len(".weight")] for hf in entry.hf}
                module.lora = LoraAdapter(config, kind, module, names, entry.transform, arch,
                                          chunk.config.sequence_parallel)
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
