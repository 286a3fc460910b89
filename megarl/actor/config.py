"""Configuration of the actor's update (loss switches, batching, optimizer, recompute, optimizer
offload) and the batching and aggregation checks the critic's config shares.

Typed and validated when built, before any process group exists; nothing here is derived later.
"""

from dataclasses import dataclass, field
from typing import Optional

from megarl.actor.optimizer import OptimConfig, OptimizerOffloadConfig, check_offload
from megarl.algos import pick
from megarl.algos.aggregation import AGGREGATIONS
from megarl.algos.kl import KL_ESTIMATORS
from megarl.algos.policy_losses import DEFAULT_AGGREGATION, POLICY_LOSSES
from megarl.algos.rollout_correction import PRESETS, Correction
from megarl.models.lora.adapters import LoraConfig
from megarl.models.megatron.config import RecomputeConfig

NORMED = "seq-mean-token-sum-norm"  # the aggregation that needs norm_tokens


def check_aggregation(aggregation: Optional[str], norm_tokens: Optional[int], section: str) -> None:
    if aggregation is not None:
        pick(AGGREGATIONS, aggregation, f"{section}.aggregation")
    if norm_tokens is not None and norm_tokens < 1:
        raise ValueError(f"{section}.norm_tokens={norm_tokens} must be >= 1 (or None: the generation "
                         "budget, generation.max_new_tokens, in a run)")


def require_norm_tokens(aggregation: str, norm_tokens: Optional[int], section: str) -> None:
    """Dr. GRPO's aggregation divides by a fixed token budget; refuse to start without one."""
    if aggregation == NORMED and norm_tokens is None:
        raise ValueError(f"{section}.aggregation={NORMED!r} divides each sequence's loss sum by a fixed "
                         f"token count: set {section}.norm_tokens (a run defaults it to "
                         "generation.max_new_tokens)")


@dataclass(frozen=True)
class BatchingConfig:
    mini_batch_size: Optional[int] = None  # sequences per optimizer step; None: the whole batch
    epochs: int = 1  # passes over the batch per update
    micro_batch_tokens: Optional[int] = None  # token budget per micro-batch (packed, per rank)
    micro_batches: int = 1  # micro-batches per DP rank when micro_batch_tokens is None
    shuffle_seed: Optional[int] = None  # shuffle rows between epochs; None keeps batch order

    def __post_init__(self):
        if self.epochs < 1 or self.micro_batches < 1:
            raise ValueError(f"epochs={self.epochs} and micro_batches={self.micro_batches} must be >= 1")
        if self.mini_batch_size is not None and self.mini_batch_size < 1:
            raise ValueError(f"mini_batch_size={self.mini_batch_size} must be >= 1 (or None)")
        if self.micro_batch_tokens is not None and self.micro_batch_tokens < 2:
            raise ValueError(f"micro_batch_tokens={self.micro_batch_tokens} must be >= 2 (or None)")


# Whose MoE routing the update replays: the rollout engine's (R3: the experts that sampled each
# token), the trainer's own old-log-prob pass's, or none (each forward routes on its own).
ROUTER_REPLAY = ("off", "old", "rollout")


@dataclass(frozen=True)
class RolloutCorrectionConfig:
    """Importance weights and rejection against the rollout engine's log-probs
    (megarl/algos/rollout_correction.py): a named preset, or preset null and the fields."""
    preset: Optional[str] = "off"  # off, tis, icepop, token_mis, seq_mis, decoupled_*: PRESETS
    weights: Optional[str] = None  # token | sequence: the level of the IS weights
    cap: Optional[float] = None  # truncate the weights at cap; null: whole ratios
    reject: Optional[str] = None  # token | sequence | geometric: drop outside [low, high]
    low: Optional[float] = None  # null: 1 / high
    high: Optional[float] = None

    def __post_init__(self):
        own = {name: getattr(self, name) for name in ("weights", "cap", "reject", "low", "high")}
        if self.preset is None:
            Correction(**own)  # raises naming the bad field
            return
        pick(PRESETS, self.preset, "actor.rollout_correction.preset")
        chosen = {name: value for name, value in own.items() if value is not None}
        if chosen:
            raise ValueError(f"actor.rollout_correction: preset {self.preset!r} sets the fields, but "
                             f"{sorted(chosen)} are given too; drop them, or set preset: null to "
                             "choose every field yourself")

    @property
    def correction(self) -> Correction:
        if self.preset is None:
            return Correction(self.weights, self.cap, self.reject, self.low, self.high)
        return PRESETS[self.preset]


@dataclass(frozen=True)
class ActorConfig:
    policy_loss: str = "ppo"
    eps_clip_low: float = 0.2
    eps_clip_high: float = 0.2  # > eps_clip_low is "clip-higher" (DAPO)
    dual_clip: Optional[float] = None  # PPO's dual clip c > 1 (verl: 3); None disables
    aggregation: Optional[str] = None  # None: the policy loss's own (DEFAULT_AGGREGATION)
    # Dr. GRPO's constant for "seq-mean-token-sum-norm"; None: generation.max_new_tokens in a run
    norm_tokens: Optional[int] = None
    entropy_coeff: float = 0.0
    kl_loss_coeff: float = 0.0  # KL to the reference as a loss term (GRPO style); 0 disables
    kl_estimator: str = "k3"
    kl_clamp: Optional[float] = None  # limit per-token KL to [-c, c] (verl: 10 for k3); None: no limit
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)
    router_aux_loss_coeff: float = 0.0
    router_replay: str = "off"  # MoE: ROUTER_REPLAY; "rollout" needs the engine's routing
    batching: BatchingConfig = field(default_factory=BatchingConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    recompute: RecomputeConfig = field(default_factory=RecomputeConfig)
    optimizer_offload: OptimizerOffloadConfig = field(default_factory=OptimizerOffloadConfig)
    # LoRA adapters on the policy (rank 0: full fine-tuning); lora.init starts them from a PEFT
    # folder
    lora: LoraConfig = field(default_factory=LoraConfig)

    def __post_init__(self):
        pick(POLICY_LOSSES, self.policy_loss, "policy_loss")
        check_offload(self.optim, self.optimizer_offload, "actor")
        check_aggregation(self.aggregation, self.norm_tokens, "actor")
        pick(KL_ESTIMATORS, self.kl_estimator, "kl_estimator")
        if self.kl_clamp is not None and self.kl_clamp <= 0:
            raise ValueError(f"actor.kl_clamp={self.kl_clamp} must be > 0 (or None for no clamp)")
        if not 0 <= self.eps_clip_low < 1 or self.eps_clip_high < 0:
            raise ValueError(f"need 0 <= eps_clip_low < 1 and eps_clip_high >= 0, got "
                             f"{self.eps_clip_low}, {self.eps_clip_high}")
        if self.router_replay not in ROUTER_REPLAY:
            raise ValueError(f"actor.router_replay={self.router_replay!r}: choose one of "
                             f"{list(ROUTER_REPLAY)} (rollout: the engine's experts, R3; old: the "
                             "old-log-prob pass's; off)")

    @property
    def loss_aggregation(self) -> str:
        return self.aggregation or DEFAULT_AGGREGATION[self.policy_loss]
