"""Configuration of the critic's update: value clipping, aggregation, batching, optimizer, recompute
and optimizer offload (as the actor's).
Typed and validated when built, before any process group exists."""

from dataclasses import dataclass, field
from typing import Optional

from megarl.actor.config import BatchingConfig, check_aggregation
from megarl.actor.optimizer import OptimConfig, OptimizerOffloadConfig, check_offload
from megarl.models.megatron.config import RecomputeConfig


@dataclass(frozen=True)
class CriticConfig:
    value_clip: float = 0.2
    aggregation: str = "token-mean"
    norm_tokens: Optional[int] = None  # as ActorConfig.norm_tokens
    batching: BatchingConfig = field(default_factory=BatchingConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    recompute: RecomputeConfig = field(default_factory=RecomputeConfig)
    optimizer_offload: OptimizerOffloadConfig = field(default_factory=OptimizerOffloadConfig)

    def __post_init__(self):
        check_aggregation(self.aggregation, self.norm_tokens, "critic")
        check_offload(self.optim, self.optimizer_offload, "critic")
        if self.value_clip <= 0:
            raise ValueError(f"value_clip={self.value_clip} must be > 0")
