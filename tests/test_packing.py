"""Packing is pure: plans from lengths, the thd layout, and unpacking, checked against loops."""

import pytest
import torch

from megarl.actor.config import ActorConfig, BatchingConfig
from megarl.actor.optimizer import OptimConfig
from megarl.actor.packing import (
    balanced_partition,
    local_positions,
    pack,
    pack_tokens,
    padded_lengths,
    plan_micro_batches,
    unpack_predictions,
    unpack_tokens,
)
from megarl.actor.passes import mini_batch_rows
from megarl.batch.rollout_batch import RolloutBatch


def test_balanced_partition_balances_and_covers():
    weights = [50, 10, 40, 30, 20, 20, 15, 5]
    parts = balanced_partition(weights, 3)
    assert sorted(i for p in parts for i in p) == list(range(len(weights)))
    loads = [sum(weights[i] for i in p) for p in parts]
    assert max(loads) - min(loads) <= max(weights) // 2
    with pytest.raises(ValueError, match="3 sequences cannot fill 4 parts"):
        balanced_partition([1, 2, 3], 4)


def test_plan_respects_the_token_budget_with_equal_counts():
    lengths = torch.randint(5, 60, (37,), generator=torch.Generator().manual_seed(0)).tolist()
    plan = plan_micro_batches(lengths, dp_size=3, micro_batch_tokens=100)
    assert len({len(rank) for rank in plan}) == 1  # same micro-batch count on every DP rank
    everything = sorted(i for rank in plan for mb in rank for i in mb)
    assert everything == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in mb) <= 100 for rank in plan for mb in rank)
    assert plan_micro_batches(lengths, 2, micro_batches=5)[0].__len__() == 5
    assert len(plan_micro_batches(lengths, 1, 10_000, min_micro_batches=4)[0]) == 4
    with pytest.raises(ValueError, match="exceeds micro_batch_tokens=40; raise"):
        plan_micro_batches([10, 50], 1, micro_batch_tokens=40)
    with pytest.raises(ValueError, match="needs at least 2"):
        plan_micro_batches(lengths, 1, micro_batches=1, min_micro_batches=2)


@pytest.mark.parametrize("tp,cp", [(1, 1), (2, 1), (1, 2), (2, 2), (4, 3)])
def test_padding_fits_the_layout(tp, cp):
    lengths = [7, 12, 5, 9]
    padded = padded_lengths(lengths, tp, cp)
    assert all(p >= n for p, n in zip(padded, lengths))
    if cp > 1:
        assert all(p % (2 * cp) == 0 for p in padded)
    assert sum(padded) % (tp * cp) == 0
    assert sum(padded) - sum(lengths) < len(lengths) * 2 * cp + 2 * cp * tp


def _rows(n=4, width=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, width + 1, (n,), generator=g)
    tokens = torch.randint(1, 100, (n, width), generator=g)
    return torch.where(torch.arange(width)[None] < lengths[:, None], tokens, 0), lengths


@pytest.mark.parametrize("tp,cp", [(1, 1), (2, 1), (1, 2), (2, 2)])
def test_pack_places_tokens_and_targets(tp, cp):
    tokens, lengths = _rows()
    rows = [2, 0, 3]
    parts = [pack(tokens, lengths, rows, tp, cp, r) for r in range(cp)]
    total = int(parts[0].cu_seqlens_padded[-1])
    held = torch.cat([p.local_index for p in parts])
    assert torch.equal(held.sort().values, torch.arange(total))  # CP ranks hold the pack exactly once
    whole, targets = torch.full((total,), -1), torch.full((total,), -1)
    for rank, part in enumerate(parts):
        assert part.tokens.shape[1] % tp == 0  # sequence parallelism splits each rank's share
        assert torch.equal(part.local_index, local_positions(part.cu_seqlens_padded, cp, rank))
        whole[part.local_index], targets[part.local_index] = part.tokens[0], part.targets[0]
    for j, row in enumerate(rows):
        start, n = int(parts[0].cu_seqlens_padded[j]), int(lengths[row])
        assert torch.equal(whole[start:start + n], tokens[row, :n])
        assert torch.equal(targets[start:start + n - 1], tokens[row, 1:n])


def test_unpack_is_the_shifted_loop():
    tokens, lengths = _rows()
    rows = [1, 3, 0]
    mb = pack(tokens, lengths, rows, 2, 1, 0)
    values = torch.randn(mb.tokens.shape[1], 3)  # [t, 3] per pack position
    got = unpack_predictions(values, mb)
    for j, row in enumerate(rows):
        start = int(mb.cu_seqlens_padded[j])
        for i in range(mb.width):
            want = values[start + i - 1] if 1 <= i < int(lengths[row]) else torch.zeros(3)
            assert torch.equal(got[j, i], want)
    per_token = unpack_tokens(values, mb, -1.0)
    assert torch.equal(unpack_tokens(pack_tokens(per_token, mb, -1.0), mb, -1.0), per_token)


def test_batch_and_config_errors_name_the_fix():
    tokens, lengths = _rows()
    mask = (torch.arange(12)[None] < lengths[:, None]).float()
    mask[:, 0] = 0
    ok = dict(tokens=tokens, lengths=lengths, loss_mask=mask, group_ids=torch.arange(4))
    RolloutBatch(**ok)
    with pytest.raises(ValueError, match="must be 0 on column 0"):
        RolloutBatch(**{**ok, "loss_mask": torch.ones(4, 12)})
    with pytest.raises(ValueError, match=r"advantages has shape \(4, 11\)"):
        RolloutBatch(**ok, advantages=torch.zeros(4, 11))
    with pytest.raises(ValueError, match="unknown policy_loss 'ppo2'"):
        ActorConfig(policy_loss="ppo2")
    with pytest.raises(ValueError, match="needs lr_decay_steps"):
        OptimConfig(lr_decay_style="cosine")
    with pytest.raises(ValueError, match="not divisible by mini_batch_size=3"):
        mini_batch_rows(8, BatchingConfig(mini_batch_size=3))
    steps = mini_batch_rows(8, BatchingConfig(mini_batch_size=4, epochs=2, shuffle_seed=0))
    assert len(steps) == 4 and all(sorted(torch.cat(steps[2 * e:2 * e + 2]).tolist()) == list(range(8))
                                   for e in range(2))


def test_lr_schedule_warms_up_then_decays():
    from megarl.actor.optimizer import lr_scheduler

    def lrs(config, steps):
        optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=config.lr)
        scheduler, seen = lr_scheduler(optimizer, config), []
        for _ in range(steps):
            seen.append(optimizer.param_groups[0]["lr"])
            scheduler.step(increment=1)
        return seen

    assert lrs(OptimConfig(lr=1.0), 3) == [1.0, 1.0, 1.0]
    got = lrs(OptimConfig(lr=1.0, min_lr=0.1, lr_warmup_steps=2, lr_decay_steps=6,
                          lr_decay_style="linear"), 8)
    expected = [0.5, 1.0] + [0.1 + 0.9 * (1 - (s - 2) / 4) for s in range(3, 7)] + [0.1, 0.1]
    assert got == pytest.approx(expected)
