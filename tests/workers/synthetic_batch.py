"""A deterministic RolloutBatch for tests: groups of sequences with uneven prompt and response
lengths, random tokens, rewards and advantages (the same on every rank for a seed)."""

import torch

from megarl.batch.rollout_batch import RolloutBatch


def synthetic_batch(vocab_size: int, groups: int = 4, group_size: int = 2, max_len: int = 40,
                    seed: int = 0) -> RolloutBatch:
    g = torch.Generator().manual_seed(seed)
    n = groups * group_size
    lengths = torch.randint(max_len // 3, max_len + 1, (n,), generator=g)
    prompt = torch.randint(2, 8, (n,), generator=g)
    tokens = torch.randint(0, vocab_size, (n, max_len), generator=g)
    cols = torch.arange(max_len)[None, :]
    tokens = torch.where(cols < lengths[:, None], tokens, 0)
    loss_mask = ((cols >= prompt[:, None]) & (cols < lengths[:, None])).float()
    advantages = torch.randn(n, max_len, generator=g) * loss_mask
    return RolloutBatch(tokens=tokens, lengths=lengths, loss_mask=loss_mask,
                        group_ids=torch.arange(groups).repeat_interleave(group_size),
                        rewards=torch.randn(n, generator=g), advantages=advantages,
                        returns=torch.randn(n, max_len, generator=g) * loss_mask)
