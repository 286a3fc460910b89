"""DAPO's loop-level pieces as pure functions: overlong reward shaping and the group filter of
dynamic sampling. Does not own regenerating prompts (the loop) or the rewards themselves."""

import torch


def overlong_penalty(response_lengths: torch.Tensor,  # [B] generated tokens
                     max_response_len: int, buffer: int, penalty: float) -> torch.Tensor:
    """[B] reward shaping: 0 up to max - buffer tokens, then linearly down to -penalty at max
    (and -penalty beyond, for truncated responses)."""
    if not 0 < buffer <= max_response_len:
        raise ValueError(f"overlong buffer {buffer} must lie in (0, max_response_len={max_response_len}]")
    over = (response_lengths.float() - (max_response_len - buffer)).clamp(min=0)
    return -penalty * (over / buffer).clamp(max=1.0)


def informative_groups(rewards: torch.Tensor,  # [B] sequence rewards
                       group_ids: torch.Tensor  # [B]
                       ) -> torch.Tensor:
    """[B] bool: samples whose group's rewards are not all equal (a group with one reward value
    has zero advantage under group baselines and teaches nothing)."""
    groups, inverse = torch.unique(group_ids, return_inverse=True)
    high = torch.full((len(groups),), -torch.inf).scatter_reduce(0, inverse, rewards.float(), "amax")
    low = torch.full((len(groups),), torch.inf).scatter_reduce(0, inverse, rewards.float(), "amin")
    return (high > low)[inverse]
