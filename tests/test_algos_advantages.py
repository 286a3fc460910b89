"""Advantage estimators against loop references (python floats, one sequence and token at a time),
with padding, holes in the mask, garbage on masked tokens, and uneven, interleaved groups."""

import math

import pytest
import torch

from megarl.algos import advantages as adv
from megarl.algos import pick

GROUP_IDS = [3, 0, 3, 1, 0, 3, 2, 1, 1, 3]  # sizes 4, 2, 3, 1 (a lone sequence), interleaved
LENGTHS = [7, 1, 4, 0, 6, 7, 3, 5, 2, 6]  # one empty response
T = 7


def _batch(holes=False):
    g = torch.Generator().manual_seed(0)
    b = len(GROUP_IDS)
    mask = torch.tensor([[t < n for t in range(T)] for n in LENGTHS])
    if holes:  # multi-turn: tool output inside a response is masked out
        mask[0, 2:4] = False
        mask[4, 1] = False
    nan = torch.full((b, T), float("nan"), dtype=torch.float64)
    return dict(
        token_rewards=torch.where(mask, torch.randn(b, T, generator=g, dtype=torch.float64), nan),
        values=torch.where(mask, torch.randn(b, T, generator=g, dtype=torch.float64), nan),
        seq_rewards=torch.randn(b, generator=g, dtype=torch.float64),
        group_ids=torch.tensor(GROUP_IDS),
        mask=mask.double(),
        gamma=0.9, lam=0.8, eps=1e-6,
    )


def _real(mask, i):
    return [t for t in range(mask.shape[1]) if mask[i, t]]


def _ref_gae(batch, gamma, lam, values=True):
    mask = batch["mask"]
    out = torch.zeros_like(mask)
    for i in range(mask.shape[0]):
        real = _real(mask, i)
        last = 0.0
        for k in reversed(range(len(real))):
            t = real[k]
            v = float(batch["values"][i, t]) if values else 0.0
            next_v = float(batch["values"][i, real[k + 1]]) if values and k + 1 < len(real) else 0.0
            last = float(batch["token_rewards"][i, t]) + gamma * next_v - v + gamma * lam * last
            out[i, t] = last
    return out


def _ref_groups(batch):
    groups = {}
    for i, gid in enumerate(batch["group_ids"].tolist()):
        groups.setdefault(gid, []).append(i)
    return groups


def _ref_centered(batch):
    r = batch["seq_rewards"].tolist()
    out = [0.0] * len(r)
    for members in _ref_groups(batch).values():
        mean = sum(r[i] for i in members) / len(members)
        for i in members:
            out[i] = r[i] - mean
    return out


def _ref_grpo(batch):
    r = batch["seq_rewards"].tolist()
    out = [0.0] * len(r)
    for members in _ref_groups(batch).values():
        if len(members) == 1:
            continue
        mean = sum(r[i] for i in members) / len(members)
        std = math.sqrt(sum((r[i] - mean) ** 2 for i in members) / (len(members) - 1))
        for i in members:
            out[i] = (r[i] - mean) / (std + batch["eps"])
    return out


def _ref_rloo(batch):
    r = batch["seq_rewards"].tolist()
    out = [0.0] * len(r)
    for members in _ref_groups(batch).values():
        for i in members:
            others = [r[j] for j in members if j != i]
            out[i] = r[i] - sum(others) / len(others) if others else 0.0
    return out


def _broadcast(per_seq, mask):
    out = torch.zeros_like(mask)
    for i in range(mask.shape[0]):
        for t in _real(mask, i):
            out[i, t] = per_seq[i]
    return out


def _ref_whiten(x, mask, eps):
    values = [float(x[i, t]) for i in range(mask.shape[0]) for t in _real(mask, i)]
    mean = sum(values) / len(values)
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))
    out = torch.zeros_like(mask)
    for i in range(mask.shape[0]):
        for t in _real(mask, i):
            out[i, t] = (float(x[i, t]) - mean) / (std + eps)
    return out


def _close(a, b, tol=1e-9):
    assert a.shape == b.shape
    assert not torch.isnan(a).any()
    torch.testing.assert_close(a, b, rtol=0, atol=tol)


@pytest.mark.parametrize("holes", [False, True])
def test_gae_matches_loop_over_real_tokens(holes):
    batch = _batch(holes)
    advantages, returns = adv.gae(**batch)
    expected = _ref_gae(batch, 0.9, 0.8)
    _close(advantages, expected)
    _close(returns, torch.where(batch["mask"].bool(), expected + batch["values"], 0))


def test_gae_ignores_what_padding_holds():
    batch = _batch()
    padded = dict(batch, token_rewards=torch.where(batch["mask"].bool(), batch["token_rewards"], 1e3),
                  values=torch.where(batch["mask"].bool(), batch["values"], -7.0))
    _close(adv.gae(**padded)[0], adv.gae(**batch)[0])
    # The last real token is terminal: its advantage is its reward minus its value.
    i, t = 2, LENGTHS[2] - 1
    _close(adv.gae(**batch)[0][i, t], batch["token_rewards"][i, t] - batch["values"][i, t])


@pytest.mark.parametrize("holes", [False, True])
def test_group_estimators_match_loops(holes):
    batch = _batch(holes)
    mask = batch["mask"]
    expected = {
        "grpo": _broadcast(_ref_grpo(batch), mask),
        "dr_grpo": _broadcast(_ref_centered(batch), mask),
        "rloo": _broadcast(_ref_rloo(batch), mask),
        "reinforce_plus_plus_baseline": _broadcast(_ref_centered(batch), mask),
    }
    for name, want in expected.items():
        advantages, returns = adv.ADVANTAGE_ESTIMATORS[name](**batch)
        _close(advantages, want)
        assert torch.equal(returns, advantages)
    lone = GROUP_IDS.index(2)
    assert LENGTHS[lone] > 0 and all(
        torch.all(adv.ADVANTAGE_ESTIMATORS[n](**batch)[0][lone] == 0) for n in ("grpo", "rloo"))


@pytest.mark.parametrize("holes", [False, True])
def test_reinforce_plus_plus_is_the_discounted_return_to_go(holes):
    batch = _batch(holes)
    advantages, _ = adv.reinforce_plus_plus(**batch)
    _close(advantages, _ref_gae(batch, 0.9, 1.0, values=False))


@pytest.mark.parametrize("holes", [False, True])
def test_whiten_over_real_tokens(holes):
    batch = _batch(holes)
    to_go = _ref_gae(batch, 0.9, 1.0, values=False)
    whitened = adv.whiten(to_go, batch["mask"], batch["eps"])
    _close(whitened, _ref_whiten(to_go, batch["mask"], batch["eps"]))
    real = whitened[batch["mask"].bool()]
    assert abs(float(real.mean())) < 1e-12 and abs(float(real.std()) - 1) < 1e-5


def test_grpo_uses_sample_std_and_equal_rewards_give_zero():
    mask = torch.ones(4, 3, dtype=torch.float64)
    rewards = torch.tensor([1.0, 0.0, 5.0, 5.0], dtype=torch.float64)
    advantages, _ = adv.grpo(seq_rewards=rewards, mask=mask, group_ids=torch.tensor([0, 0, 1, 1]),
                             eps=1e-6)
    # Group {1, 0}: mean 0.5, sample std sqrt(0.5); population std would give +-1.
    expected = torch.tensor([0.5, -0.5], dtype=torch.float64) / (math.sqrt(0.5) + 1e-6)
    _close(advantages[:2], expected[:, None].expand(2, 3))
    assert torch.equal(advantages[2:], torch.zeros(2, 3, dtype=torch.float64))


def test_every_estimator_takes_the_same_arguments():
    batch = _batch()
    for name in ("gae", "grpo", "dr_grpo", "rloo", "reinforce_plus_plus",
                 "reinforce_plus_plus_baseline"):
        advantages, returns = pick(adv.ADVANTAGE_ESTIMATORS, name, "advantage estimator")(**batch)
        assert advantages.shape == returns.shape == (len(GROUP_IDS), T)
        assert torch.all(advantages[~batch["mask"].bool()] == 0)
    with pytest.raises(ValueError, match=r"'gpro'.*\['dr_grpo', 'gae', 'grpo'"):
        pick(adv.ADVANTAGE_ESTIMATORS, "gpro", "advantage estimator")
    with pytest.raises(TypeError, match="values"):
        adv.gae(token_rewards=batch["token_rewards"], mask=batch["mask"], gamma=1.0, lam=1.0)
