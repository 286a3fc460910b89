"""DAPO dynamic sampling's batch assembly (rollout.collect.keep_informative) against a plain
loop over groups: rounds of different widths, informative groups first in round order, then
fillers, and every per-token field carried with its row, the engine's routing included. Rounds
are laid out by rollout.collect.to_batch from engine samples."""

import pytest
import torch

from megarl.rollout.collect import Collected, keep_informative, to_batch
from megarl.rollout.engine import RolloutSample

LAYERS, TOPK = 3, 2


def _sample(group, n, g, routing=True):
    """An engine sample of n tokens: 2 prompt tokens; routing for the n - 1 tokens it fed."""
    tokens = torch.randint(1, 50, (n,), generator=g).tolist()
    experts = torch.randint(0, 8, (n - 1, LAYERS, TOPK), generator=g).to(torch.int16)
    return RolloutSample(prompt_ids=tokens[:2], response_ids=tokens[2:],
                         logprobs=-torch.rand(n - 2, generator=g), prompt_index=group,
                         routed_experts=experts if routing else None)


def _round(rewards, lengths, seed):
    """A round of rollouts: groups of len(rewards[g]) samples, prompts of 2 tokens."""
    g = torch.Generator().manual_seed(seed)
    rows = [(group, r, n) for group, (rs, ns) in enumerate(zip(rewards, lengths)) for r, n in zip(rs, ns)]
    samples = [_sample(group, n, g) for group, _, n in rows]
    batch = to_batch(samples, torch.tensor([r for _, r, _ in rows]))
    for row, sample in enumerate(samples):  # input-token aligned: token i's experts in column i
        fed = len(sample.prompt_ids) + len(sample.response_ids) - 1
        assert torch.equal(batch.rollout_routing[row, :fed], sample.routed_experts)
        assert bool((batch.rollout_routing[row, fed:] == -1).all())
    # a dict reward's extra field, only in the first round: the second's rows get NaN when merged
    extras = {"acc": torch.arange(len(rows), dtype=torch.float32)} if seed == 1 else {}
    return Collected(batch, [f"s{seed}-{i}" for i in range(len(rows))], seed, seed, "", 0, extras)


def test_to_batch_refuses_routing_that_does_not_fit_the_tokens():
    g = torch.Generator().manual_seed(0)
    short = _sample(0, 6, g)
    short.routed_experts = short.routed_experts[:-1]
    with pytest.raises(RuntimeError, match=r"sample 1: routing \(4, 3, 2\) for 5 tokens"):
        to_batch([_sample(0, 5, g), short], torch.zeros(2))
    with pytest.raises(RuntimeError, match="routing for 1 of 2 samples"):
        to_batch([_sample(0, 5, g), _sample(0, 5, g, routing=False)], torch.zeros(2))


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
            assert torch.equal(kept.batch.rollout_routing[row, :n], src.rollout_routing[i, :n])
            assert bool((kept.batch.rollout_routing[row, n:] == -1).all())
            assert not kept.batch.loss_mask[row, n:].any()
            acc = float(kept.reward_extras["acc"][row])
            assert acc == i if k == 0 else acc != acc  # NaN: round 1 returned no such field
        # groups of different rounds never share an id
        pairs = {(k, int(parts[k].batch.group_ids[i])) for k, i in rows}
        assert len(torch.unique(kept.batch.group_ids)) == len(pairs) == groups
    assert kept.reward_failures == kept.reward_timeouts == 1 + 2  # counted over every round generated
