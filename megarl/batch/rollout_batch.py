"""RolloutBatch: the one batch type of the loop, held whole on every rank.

N sequences (prompt + response) as right-padded rows [N, L]. Per-token fields are aligned with
`tokens`: column i holds the quantity of token i, computed from the model's output at position
i - 1 (log p(tokens[:, i] | tokens[:, :i]), the critic's value of the state before token i).
Column 0 predicts nothing and holds 0. Phases add fields with `with_fields`, never in place.
Does not own packing for compute (packing.py) or how fields are computed (actor, critic, algos).
"""

import dataclasses
from dataclasses import dataclass
from typing import Optional

import torch

PER_TOKEN = ("rollout_logprobs", "old_logprobs", "ref_logprobs", "teacher_logprobs", "teacher_top1", "values",
             "advantages", "returns")
ROUTING = ("rollout_routing", "old_routing")


@dataclass(frozen=True)
class RolloutBatch:
    tokens: torch.Tensor  # [N, L] long, right-padded
    lengths: torch.Tensor  # [N] long, prompt + response tokens
    loss_mask: torch.Tensor  # [N, L] float, 1 on response tokens (the ones the policy generated)
    group_ids: torch.Tensor  # [N] long, samples of one prompt share an id
    rewards: Optional[torch.Tensor] = None  # [N] sequence rewards
    rollout_logprobs: Optional[torch.Tensor] = None  # [N, L] from the rollout engine
    old_logprobs: Optional[torch.Tensor] = None  # [N, L] the actor before this step's update
    ref_logprobs: Optional[torch.Tensor] = None  # [N, L] the reference policy
    teacher_logprobs: Optional[torch.Tensor] = None  # [N, L] the distillation teacher (megarl/teacher)
    teacher_top1: Optional[torch.Tensor] = None  # [N, L] float: 1 where token i is the teacher's most likely
    values: Optional[torch.Tensor] = None  # [N, L] the critic before this step's update
    advantages: Optional[torch.Tensor] = None  # [N, L]
    returns: Optional[torch.Tensor] = None  # [N, L] value targets
    # MoE routing [N, L, layers, k] int32 expert ids, input-token aligned (column i: the experts
    # token i went through in each layer), -1 where nothing was routed (padding, dense layers)
    rollout_routing: Optional[torch.Tensor] = None  # the rollout engine's, as it sampled
    old_routing: Optional[torch.Tensor] = None  # the trainer's, in the old-log-prob pass
    # [N, L] long: the policy version that sampled each response token (asynchronous rollouts),
    # -1 elsewhere
    rollout_versions: Optional[torch.Tensor] = None

    def __post_init__(self):
        n, width = self.tokens.shape
        if self.lengths.shape != (n,) or self.group_ids.shape != (n,):
            raise ValueError(f"lengths {tuple(self.lengths.shape)} and group_ids "
                             f"{tuple(self.group_ids.shape)} must both be ({n},) for tokens [{n}, {width}]")
        if int(self.lengths.min()) < 2 or int(self.lengths.max()) > width:
            raise ValueError(f"sequence lengths must lie in [2, {width}] (a prompt token and a response "
                             f"token at least), got {int(self.lengths.min())}..{int(self.lengths.max())}")
        for name in ("loss_mask", "rollout_versions") + PER_TOKEN:
            value = getattr(self, name)
            if value is not None and value.shape != (n, width):
                raise ValueError(f"{name} has shape {tuple(value.shape)}, expected ({n}, {width})")
        for name in ROUTING:
            value = getattr(self, name)
            if value is not None and (value.dim() != 4 or value.shape[:2] != (n, width)):
                raise ValueError(f"{name} has shape {tuple(value.shape)}, expected ({n}, {width}, "
                                 "layers, top-k)")
        beyond = torch.arange(width)[None, :] >= self.lengths[:, None]
        if bool(self.loss_mask[:, 0].any()) or bool((self.loss_mask.bool() & beyond).any()):
            raise ValueError("loss_mask must be 0 on column 0 (nothing predicts the first token) and "
                             "on padding beyond each sequence's length")

    @property
    def size(self) -> int:
        return self.tokens.shape[0]

    @property
    def width(self) -> int:
        return self.tokens.shape[1]

    def with_fields(self, **fields) -> "RolloutBatch":
        return dataclasses.replace(self, **fields)

    def select(self, rows: torch.Tensor) -> "RolloutBatch":
        """The sub-batch of `rows` [n] (long), every field indexed alike."""
        return dataclasses.replace(self, **{
            f.name: None if getattr(self, f.name) is None else getattr(self, f.name)[rows]
            for f in dataclasses.fields(self)})
