"""ParallelDims: the validated parallel layout (tp, pp, vpp, ep, etp, cp, dp) of one job.

Owns the arithmetic and its validation, done before any process group exists.
Does not own process groups: see `megatron_groups.py` for the one adapter to Megatron-Core.
"""

import math
from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class ParallelDims:
    world_size: int
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    etp: Optional[int] = None  # expert tensor parallel; None means "same as tp"
    vpp: Optional[int] = None  # virtual pipeline stages per rank; None means no interleaving

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
        """Layers split over as many pipeline stages as the world allows, nothing TP-sharded:
        each rank holds whole tensors of 1/pp of the model, and can read/write them directly."""
        return cls(world_size=world_size, pp=math.gcd(world_size, num_layers))

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

    def describe(self) -> dict:
        return {
            "world_size": self.world_size, "tp": self.tp, "pp": self.pp, "vpp": self.vpp,
            "cp": self.cp, "ep": self.ep, "etp": self.expert_tp, "dp": self.dp,
        }

    def check_model(self, *, num_layers: int, num_heads: int, num_kv_heads: int,
                    num_experts: int = 0, ffn_hidden: int = 0, moe_ffn_hidden: int = 0) -> None:
        """Raise ValueError if the model's shapes cannot be split over this layout."""
        stages = self.pp * self.virtual_stages
        if num_layers % stages:
            raise ValueError(
                f"num_layers({num_layers}) must be divisible by pp({self.pp}) * vpp"
                f"({self.virtual_stages}) = {stages}: choose pp/vpp that divide {num_layers}"
            )
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
