"""ParallelDims: the validated parallel layout (tp, pp, vpp, ep, etp, cp, dp) of one job.

Owns the arithmetic and its validation, done before any process group exists.
Does not own process groups: see `megatron_groups.py` for the one adapter to Megatron-Core.
"""

import itertools
import math
from dataclasses import dataclass, replace
from typing import List, Optional


@dataclass(frozen=True)
class ParallelDims:
    world_size: int
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    etp: Optional[int] = None  # expert tensor parallel; None means "same as tp"
    vpp: Optional[int] = None  # virtual pipeline stages per rank; None means no interleaving
    # Uneven pipelines (Megatron's num_layers_in_first/last_pipeline_stage), for layer counts no
    # even split fits (DeepSeek-V3's 61); None: the stage gets an even share like the others.
    first_stage_layers: Optional[int] = None
    last_stage_layers: Optional[int] = None

    def __post_init__(self):
        for name in ("world_size", "tp", "pp", "cp", "ep"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.etp is not None and (not isinstance(self.etp, int) or self.etp < 1):
            raise ValueError(f"etp must be a positive integer or None, got {self.etp!r}")
        if self.vpp is not None and (not isinstance(self.vpp, int) or self.vpp < 1):
            raise ValueError(f"vpp must be a positive integer or None, got {self.vpp!r}")
        if self.vpp is not None and self.vpp > 1 and self.pp == 1:
            raise ValueError(
                f"vpp({self.vpp}) needs pipeline parallelism, but pp is 1: set pp > 1 or vpp=None"
            )
        for name in ("first_stage_layers", "last_stage_layers"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive integer or None, got {value!r}")
            if value is not None and self.pp == 1:
                raise ValueError(f"{name}={value} needs pipeline parallelism, but pp is 1")
            if value is not None and self.vpp is not None:
                raise ValueError(f"{name}={value} with vpp={self.vpp}: megarl runs uneven pipeline "
                                 "stages without interleaving; set vpp=None")
        if self.pp == 2 and self.first_stage_layers and self.last_stage_layers:
            raise ValueError("with pp=2 set first_stage_layers or last_stage_layers, not both: the "
                             "other stage takes the remaining layers")
        dense = self.tp * self.pp * self.cp
        if self.world_size % dense:
            raise ValueError(
                f"tp({self.tp}) * pp({self.pp}) * cp({self.cp}) * dp(?) must equal world size "
                f"{self.world_size}: {dense} does not divide {self.world_size}"
            )
        # Megatron folds experts over the same ranks: ep * etp * pp * expert-dp == world.
        expert = self.expert_tp * self.ep * self.pp
        if self.world_size % expert:
            raise ValueError(
                f"etp({self.expert_tp}) * ep({self.ep}) * pp({self.pp}) * expert_dp(?) must equal "
                f"world size {self.world_size}: {expert} does not divide {self.world_size}"
            )

    @classmethod
    def for_conversion(cls, world_size: int, num_layers: int) -> "ParallelDims":
        """Every rank its own pipeline stage, nothing TP-sharded: each rank holds whole tensors of
        its share of the layers, and can read/write them directly. Layer counts no even split
        fits (DeepSeek-V3's 61) give the first and last stage fewer layers than the others. A
        world larger than the layer count (a whole allocation of nodes for a small model) takes as
        many stages as divide it and fit, and the other ranks are data-parallel replicas."""
        pp = max(d for d in range(1, min(world_size, num_layers) + 1) if world_size % d == 0)
        return cls(world_size=world_size, pp=pp).fit_stages(num_layers)

    def fit_stages(self, num_layers: int) -> "ParallelDims":
        """This layout with the converter's uneven stages (conversion_ends) when num_layers has no
        even split over pp and neither end's size is set; the check scripts take it so that a
        model the converter splits checks at the same PP. Unchanged with the ends set, with VPP
        (megarl interleaves only even stages) or fewer layers than stages: stage_layers then
        accepts it or refuses it by name."""
        if self.uneven or self.vpp is not None or num_layers < self.pp:
            return self
        return replace(self, **conversion_ends(num_layers, self.pp))

    @property
    def uneven(self) -> bool:
        return self.first_stage_layers is not None or self.last_stage_layers is not None

    def stage_layers(self, num_layers: int) -> List[int]:
        """Layers per pipeline stage (per model chunk with VPP: pp * vpp even chunks), as
        Megatron-Core builds them; ValueError naming the values when they do not fit."""
        stages = self.pp * self.virtual_stages
        if not self.uneven:
            if num_layers % stages:
                raise ValueError(
                    f"num_layers({num_layers}) must be divisible by pp({self.pp}) * vpp"
                    f"({self.virtual_stages}) = {stages}: choose pp/vpp that divide {num_layers}, or "
                    f"give the first/last stage fewer layers (first_stage_layers, last_stage_layers)")
            return [num_layers // stages] * stages
        ends = [n for n in (self.first_stage_layers, self.last_stage_layers) if n is not None]
        middle_stages, middle_layers = self.pp - len(ends), num_layers - sum(ends)
        if (self.pp == 2 and len(ends) == 1) and middle_layers > 0:
            counts = [middle_layers]  # the other stage of two
        elif middle_stages and middle_layers > 0 and middle_layers % middle_stages == 0:
            counts = [middle_layers // middle_stages] * middle_stages
        else:
            raise ValueError(
                f"first_stage_layers={self.first_stage_layers} and last_stage_layers="
                f"{self.last_stage_layers} leave {middle_layers} of num_layers({num_layers}) for "
                f"{middle_stages} other pipeline stages: they must split evenly, >= 1 each")
        first = [self.first_stage_layers] if self.first_stage_layers is not None else []
        last = [self.last_stage_layers] if self.last_stage_layers is not None else []
        return first + counts + last

    def chunk_layers(self, num_layers: int) -> List[range]:
        """The global layer indices of each model chunk, in chunk order: Megatron gives chunk
        c = vp_stage * pp + pp_rank the c-th run of stage_layers (get_transformer_layer_offset),
        so pipeline rank r holds chunks r, r + pp, ..."""
        counts = self.stage_layers(num_layers)
        starts = itertools.accumulate([0] + counts)
        return [range(start, start + count) for start, count in zip(starts, counts)]

    @property
    def expert_tp(self) -> int:
        return self.tp if self.etp is None else self.etp

    @property
    def dp(self) -> int:
        return self.world_size // (self.tp * self.pp * self.cp)

    @property
    def expert_dp(self) -> int:
        return self.world_size // (self.expert_tp * self.ep * self.pp)

    @property
    def virtual_stages(self) -> int:
        return self.vpp or 1

    def megatron_sizes(self) -> dict:
        """The keyword arguments Megatron-Core's groups and TransformerConfig both take."""
        return dict(tensor_model_parallel_size=self.tp, pipeline_model_parallel_size=self.pp,
                    virtual_pipeline_model_parallel_size=self.vpp, context_parallel_size=self.cp,
                    expert_model_parallel_size=self.ep, expert_tensor_parallel_size=self.expert_tp)

    def uneven_sizes(self) -> dict:
        """TransformerConfig's uneven-pipeline fields (the process groups do not depend on them)."""
        return dict(num_layers_in_first_pipeline_stage=self.first_stage_layers,
                    num_layers_in_last_pipeline_stage=self.last_stage_layers)

    def describe(self) -> dict:
        out = {
            "world_size": self.world_size, "tp": self.tp, "pp": self.pp, "vpp": self.vpp,
            "cp": self.cp, "ep": self.ep, "etp": self.expert_tp, "dp": self.dp,
        }
        if self.uneven:
            out.update(first_stage_layers=self.first_stage_layers, last_stage_layers=self.last_stage_layers)
        return out

    def check_model(self, *, num_layers: int, num_heads: int, num_kv_heads: int,
                    num_experts: int = 0, ffn_hidden: int = 0, moe_ffn_hidden: int = 0) -> None:
        """Raise ValueError if the model's shapes cannot be split over this layout."""
        self.stage_layers(num_layers)
        if num_heads % self.tp:
            raise ValueError(f"num_attention_heads({num_heads}) must be divisible by tp({self.tp})")
        if num_kv_heads % self.tp:
            raise ValueError(
                f"num_key_value_heads({num_kv_heads}) must be divisible by tp({self.tp}): "
                f"Megatron-Core shards whole query groups; use tp <= {num_kv_heads} that divides it"
            )
        if ffn_hidden and ffn_hidden % self.tp:
            raise ValueError(f"intermediate_size({ffn_hidden}) must be divisible by tp({self.tp})")
        if num_experts:
            if num_experts % self.ep:
                raise ValueError(f"num_experts({num_experts}) must be divisible by ep({self.ep})")
            if moe_ffn_hidden % self.expert_tp:
                raise ValueError(
                    f"moe_intermediate_size({moe_ffn_hidden}) must be divisible by "
                    f"etp({self.expert_tp})"
                )
        elif self.ep > 1:
            raise ValueError(f"ep({self.ep}) > 1 needs an MoE model, but this model has no experts")

    def check_sequence(self, seq_len: int) -> None:
        """Context parallelism splits each sequence into 2*cp load-balanced chunks."""
        if self.cp > 1 and seq_len % (2 * self.cp):
            raise ValueError(
                f"sequence length {seq_len} must be divisible by 2 * cp = {2 * self.cp}; "
                f"pad sequences to a multiple of {2 * self.cp}"
            )
        if self.tp > 1 and seq_len % (self.tp * self.cp):
            raise ValueError(
                f"sequence length {seq_len} must be divisible by tp({self.tp}) * cp({self.cp}) "
                f"for sequence parallelism; pad sequences to a multiple of {self.tp * self.cp}"
            )


def conversion_ends(num_layers: int, stages: int) -> dict:
    """Pure: first/last stage sizes splitting num_layers (>= stages) over `stages` pipeline stages,
    every stage >= 1 layer; {} when an even split fits. The middle stages take
    ceil(num_layers / stages), as few as that leaves >= 1 layer for each end, and the ends share the
    rest: no stage is larger than the middle ones (61 over 8: 6, 8 x 6, 7)."""
    if num_layers % stages == 0:
        return {}
    if stages == 2:  # Megatron's two stages take one end's size; the other stage holds the rest
        return dict(first_stage_layers=num_layers // 2)
    middle = min(math.ceil(num_layers / stages), (num_layers - 2) // (stages - 2))
    ends = num_layers - (stages - 2) * middle
    return dict(first_stage_layers=ends // 2, last_stage_layers=ends - ends // 2)
