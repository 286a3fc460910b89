"""DAPO dynamic sampling's batch assembly (rollout.collect.keep_informative) against a plain
loop over groups: rounds of different widths, informative groups first in round order, then
fillers, and every per-token field carried with its row."""

import torch

from megarl.batch.rollout_batch import RolloutBatch
from megarl.rollout.collect import Collected, keep_informative


def _round(rewards, lengths, seed):
    """A round of rollouts: groups of len(rewards[g]) samples, prompts of 2 tokens."""
    g = torch.Generator().manual_seed(seed)
    rows = [(group, r, n) for group, (rs, ns) in enumerate(zip(rewards, lengths)) for r, n in zip(rs, ns)]
    width = max(n for _, _, n in rows)
    tokens = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width)
    logprobs = torch.zeros(len(rows), width)
    for i, (_, _, n) in enumerate(rows):
        tokens[i, :n] = torch.randint(1, 50, (n,), generator=g)
        mask[i, 2:n] = 1
        logprobs[i, 2:n] = -torch.rand(n - 2, generator=g)
    batch = RolloutBatch(tokens=tokens, lengths=torch.tensor([n for _, _, n in rows]), loss_mask=mask,
                         group_ids=torch.tensor([grp for grp, _, _ in rows]),
                         rewards=torch.tensor([r for _, r, _ in rows]), rollout_logprobs=logprobs)
    return Collected(batch, [f"s{seed}-{i}" for i in range(len(rows))], seed, "", 0)


def _reference(parts, groups):
    """Plain loop: (round, group) pairs whose rewards differ first, then the others, in order."""
    informative, others = [], []
    for k, part in enumerate(parts):
        for group in sorted(set(part.batch.group_ids.tolist())):
            rows = [i for i, g in enumerate(part.batch.group_ids.tolist()) if g == group]
            rewards = {float(part.batch.rewards[i]) for i in rows}
            (informative if len(rewards) > 1 else others).append((k, rows))
    return (informative + others)[:groups]


def test_keep_informative_matches_a_loop_over_groups():
    parts = [_round([[1, 1, 1], [0, 1, 0], [0, 0, 0]], [[5, 6, 4], [3, 7, 5], [4, 4, 4]], 1),
             _round([[1, 0, 1], [1, 1, 1], [0.5, 0, 1]], [[9, 3, 4], [5, 5, 5], [6, 8, 3]], 2)]
    for groups in (1, 2, 3, 4, 5):
        kept = keep_informative(parts, groups)
        expected = _reference(parts, groups)
        rows = [(k, i) for k, group_rows in sorted(expected) for i in group_rows]
        assert kept.batch.size == len(rows) == 3 * groups
        assert kept.responses == [parts[k].responses[i] for k, i in rows]
        assert kept.batch.width == max(int(parts[k].batch.lengths[i]) for k, i in rows)
        for row, (k, i) in enumerate(rows):
            src = parts[k].batch
            n = int(src.lengths[i])
            assert kept.batch.lengths[row] == n and kept.batch.rewards[row] == src.rewards[i]
            assert torch.equal(kept.batch.tokens[row, :n], src.tokens[i, :n])
            assert torch.equal(kept.batch.rollout_logprobs[row, :n], src.rollout_logprobs[i, :n])
            assert torch.equal(kept.batch.loss_mask[row, :n], src.loss_mask[i, :n])
            assert not kept.batch.loss_mask[row, n:].any()
        # groups of different rounds never share an id
        pairs = {(k, int(parts[k].batch.group_ids[i])) for k, i in rows}
        assert len(torch.unique(kept.batch.group_ids)) == len(pairs) == groups
    assert kept.reward_failures == 1 + 2  # counted over every round generated
