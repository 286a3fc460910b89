"""Configuration of the critic's update: value clipping, aggregation, batching, optimizer.
Typed and validated when built, before any process group exists."""

from dataclasses import dataclass, field
from typing import Optional

from megarl.actor.config import BatchingConfig, check_aggregation
from megarl.actor.optimizer import OptimConfig


@dataclass(frozen=True)
class CriticConfig:
    value_clip: float = 0.2
    aggregation: str = "token-mean"
    norm_tokens: Optional[int] = None  # as ActorConfig.norm_tokens
    batching: BatchingConfig = field(default_factory=BatchingConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)

    def __post_init__(self):
        check_aggregation(self.aggregation, self.norm_tokens, "critic")
        if self.value_clip <= 0:
            raise ValueError(f"value_clip={self.value_clip} must be > 0")
