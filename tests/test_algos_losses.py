"""Policy losses, KL estimators, entropy, value loss and aggregation against loop references on
random fp64 data with padding, plus gradients and split-invariance of the aggregated loss."""

import math
import random

import pytest
import torch

from megarl.algos import kl, pick
from megarl.algos import policy_losses as pl
from megarl.algos import rollout_correction as rc
from megarl.algos.aggregation import AGGREGATIONS, aggregate
from megarl.algos.value_loss import clipped_value_loss
from tests.test_algos_vocab_parallel import entropy_from_logits

B, T = 6, 9
LENGTHS = [9, 3, 6, 0, 1, 7]
LOW, HIGH, DUAL = 0.2, 0.28, 3.0


def _rand(*shape, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64) * scale


def _mask():
    return torch.tensor([[float(t < n) for t in range(T)] for n in LENGTHS], dtype=torch.float64)


def _tokens(mask):
    return [(i, t) for i in range(mask.shape[0]) for t in range(mask.shape[1]) if mask[i, t]]


def _inputs(seq_advantages=False):
    mask = _mask()
    old = -_rand(B, T, seed=1).abs() - 0.5
    logprobs = (old + _rand(B, T, seed=2, scale=0.3)).requires_grad_()
    advantages = _rand(B, 1, seed=3).expand(B, T).clone() if seq_advantages else _rand(B, T, seed=3)
    return dict(logprobs=logprobs, old_logprobs=old, advantages=advantages, mask=mask,
                eps_clip_low=LOW, eps_clip_high=HIGH)


def _check(got, want, mask, tol=1e-9):
    """got [B, T] equals want on real tokens and is exactly 0 on padding."""
    got = got.detach()
    for i in range(mask.shape[0]):
        for t in range(mask.shape[1]):
            if mask[i, t]:
                assert abs(float(got[i, t]) - want[i][t]) <= tol, (i, t, float(got[i, t]), want[i][t])
            else:
                assert float(got[i, t]) == 0.0


def _grid(fill=0.0):
    return [[fill] * T for _ in range(B)]


def _ref_ppo(x, dual=None, w=None):
    x = dict(x, logprobs=x["logprobs"].detach())
    loss, clipped, grad = _grid(), _grid(), _grid()
    for i, t in _tokens(x["mask"]):
        a, r = float(x["advantages"][i, t]), math.exp(float(x["logprobs"][i, t] - x["old_logprobs"][i, t]))
        plain, capped = -a * r, -a * min(max(r, 1 - LOW), 1 + HIGH)
        value, cut = max(plain, capped), capped > plain
        if dual is not None and a < 0 and -a * dual < value:
            value, cut = -a * dual, True
        weight = 1.0 if w is None else float(w[i, t])
        loss[i][t], clipped[i][t] = value * weight, float(cut)
        grad[i][t] = 0.0 if cut else -a * r * weight  # d(-A * exp(lp - old)) / d lp
    return loss, clipped, grad


@pytest.mark.parametrize("dual", [None, DUAL])
@pytest.mark.parametrize("weighted", [False, True])
def test_ppo_loss_indicator_and_gradient_match_loop(dual, weighted):
    x = _inputs()
    w = rc.apply(x["old_logprobs"], x["old_logprobs"] + _rand(B, T, seed=4, scale=0.5), x["mask"],
                 rc.Correction(weights="token", cap=1.5)).weights if weighted else None
    loss, clipped = pl.ppo(**x, dual_clip=dual, is_weights=w)
    want_loss, want_clipped, want_grad = _ref_ppo(x, dual, w)
    _check(loss, want_loss, x["mask"])
    _check(clipped, want_clipped, x["mask"])
    loss.sum().backward()
    _check(x["logprobs"].grad, want_grad, x["mask"])
    assert 0 < clipped.sum() < x["mask"].sum()  # the data exercises both branches
    if dual is not None:  # dual clip actually bit somewhere
        assert (loss.detach() < torch.maximum(-x["advantages"] * torch.exp(x["logprobs"] - x["old_logprobs"]),
                                               -x["advantages"] * (1 - LOW))).any()


def test_dual_clip_validation():
    with pytest.raises(ValueError, match="dual_clip must be greater than 1.*0.5"):
        pl.ppo(**_inputs(), dual_clip=0.5)


def _paper_gspo_objective(x):
    """GSPO's sequence-level objective written per sequence, negated: its gradient is the target."""
    total = 0.0
    for i in range(B):
        real = [t for t in range(T) if x["mask"][i, t]]
        if not real:
            continue
        s = torch.exp(sum(x["logprobs"][i, t] - x["old_logprobs"][i, t] for t in real) / len(real))
        a = float(x["advantages"][i, 0])
        total = total + torch.maximum(-a * s, -a * s.clamp(1 - LOW, 1 + HIGH))
    return total / B


def test_gspo_has_sequence_ratio_value_and_paper_gradient():
    x = _inputs(seq_advantages=True)
    x["logprobs"].data[2] += 0.5  # one sequence far outside the clip range
    loss, clipped = pl.gspo(**x)
    want_loss, want_clipped = _grid(), _grid()
    logprobs = x["logprobs"].detach()
    for i in range(B):
        real = [t for t in range(T) if x["mask"][i, t]]
        if not real:
            continue
        s = math.exp(sum(float(logprobs[i, t] - x["old_logprobs"][i, t]) for t in real) / len(real))
        a = float(x["advantages"][i, 0])
        for t in real:
            want_loss[i][t] = max(-a * s, -a * min(max(s, 1 - LOW), 1 + HIGH))
            want_clipped[i][t] = float(-a * min(max(s, 1 - LOW), 1 + HIGH) > -a * s)
    _check(loss, want_loss, x["mask"])
    _check(clipped, want_clipped, x["mask"])
    assert clipped[2, :LENGTHS[2]].all() and clipped.sum() < x["mask"].sum()
    ours = aggregate(loss, x["mask"], "seq-mean-token-mean", x["mask"].sum(), B, T)
    (grad,) = torch.autograd.grad(ours, x["logprobs"])
    (want,) = torch.autograd.grad(_paper_gspo_objective(x), x["logprobs"])
    torch.testing.assert_close(grad, want, rtol=0, atol=1e-12)
    assert grad.abs().max() > 1e-3


def test_gspo_token_gradient_is_sequence_ratio_times_token_advantage():
    x = _inputs()  # GSPO-token: advantages vary along a sequence
    loss, clipped = pl.gspo(**x)
    loss.sum().backward()
    want = _grid()
    for i in range(B):
        real = [t for t in range(T) if x["mask"][i, t]]
        s = math.exp(sum(float(x["logprobs"][i, t].detach() - x["old_logprobs"][i, t]) for t in real)
                     / max(len(real), 1))
        for t in real:
            want[i][t] = 0.0 if clipped[i, t] else -float(x["advantages"][i, t]) * s
    _check(x["logprobs"].grad, want, x["mask"])


def test_cispo_keeps_every_gradient_through_a_clipped_weight():
    x = _inputs()
    w = _rand(B, T, seed=7).abs()
    loss, clipped = pl.cispo(**x, is_weights=w)
    want_loss, want_clipped, want_grad = _grid(), _grid(), _grid()
    for i, t in _tokens(x["mask"]):
        a, lp = float(x["advantages"][i, t]), float(x["logprobs"][i, t].detach())
        r = math.exp(lp - float(x["old_logprobs"][i, t]))
        weight = min(max(r, 1 - LOW), 1 + HIGH)
        want_loss[i][t] = -weight * a * lp * float(w[i, t])
        want_grad[i][t] = -weight * a * float(w[i, t])
        want_clipped[i][t] = float(r < 1 - LOW or r > 1 + HIGH)
    _check(loss, want_loss, x["mask"])
    _check(clipped, want_clipped, x["mask"])
    loss.sum().backward()
    _check(x["logprobs"].grad, want_grad, x["mask"])
    assert 0 < clipped.sum() < x["mask"].sum()


def test_every_policy_loss_takes_the_same_arguments():
    for name in ("ppo", "gspo", "cispo"):
        loss, clipped = pick(pl.POLICY_LOSSES, name, "policy loss")(**_inputs(), dual_clip=None,
                                                                    is_weights=None)
        assert loss.shape == clipped.shape == (B, T)
    with pytest.raises(ValueError, match=r"'grpo'.*\['cispo', 'gspo', 'ppo'\]"):
        pick(pl.POLICY_LOSSES, "grpo", "policy loss")


def test_kl_estimators_match_formulas():
    logprobs, ref = -_rand(B, T, seed=8).abs(), -_rand(B, T, seed=9).abs()
    formulas = {
        "k1": lambda lp, rf: lp - rf,
        "k2": lambda lp, rf: 0.5 * (lp - rf) ** 2,
        "k3": lambda lp, rf: math.exp(rf - lp) - (rf - lp) - 1,
        "low_var_kl": _verl_low_var_kl,
    }
    assert set(kl.KL_ESTIMATORS) == set(formulas)
    for name, formula in formulas.items():
        got = kl.KL_ESTIMATORS[name](logprobs, ref)
        _check(got, [[formula(float(logprobs[i, t]), float(ref[i, t])) for t in range(T)] for i in range(B)],
               torch.ones(B, T), tol=1e-12)
    assert (kl.k3(logprobs, ref) >= 0).all()
    # Near-identical policies: k3 ~ d^2 / 2 keeps its digits (exp(d) - d - 1 would cancel them away).
    tiny = kl.k3(torch.tensor([1e-9], dtype=torch.float64), torch.zeros(1, dtype=torch.float64))
    assert abs(float(tiny) / 0.5e-18 - 1) < 1e-6


def _verl_low_var_kl(lp: float, rf: float) -> float:
    """verl's kl_penalty "low_var_kl" as its core_algos writes it: log-ratio clamped to [-20, 20],
    then exp(d) - d - 1 clamped to [-10, 10]."""
    d = min(20.0, max(-20.0, rf - lp))
    return min(10.0, max(-10.0, math.exp(d) - d - 1))


def test_verl_kl_recipe_is_exact_where_the_clamps_bite():
    """verl clamps only its k3 (low_var_kl); its k1 ("kl", the reward penalty's default) and k2
    ("mse") are not clamped. The recipe (docs/algorithms.md: k1 penalty with no kl_clamp,
    kl_estimator=low_var_kl for the KL loss) equals verl's formulas on log-ratios from 1e-3 to 60
    either way, where kl_clamp=10 on k1 or k2 would not (|d| > 10 for k1, > 4.47 for k2)."""
    gaps = [s * v for v in (1e-3, 0.5, 3.0, 4.6, 11.0, 19.0, 25.0, 60.0) for s in (1, -1)]
    ref = torch.zeros(len(gaps), dtype=torch.float64)
    logprobs = torch.tensor(gaps, dtype=torch.float64)  # d = ref - logprobs = -gap
    verl = {"k1": [g for g in gaps], "k2": [0.5 * g * g for g in gaps],
            "low_var_kl": [_verl_low_var_kl(g, 0.0) for g in gaps]}
    for name, want in verl.items():
        got = kl.kl(logprobs, ref, name, None)
        assert torch.allclose(got, torch.tensor(want, dtype=torch.float64), rtol=1e-12, atol=1e-14), name
    # the generic clamp is not verl's for k1 / k2: it cuts the large gaps verl leaves alone
    assert not torch.allclose(kl.kl(logprobs, ref, "k1", 10.0), torch.tensor(verl["k1"], dtype=torch.float64))
    assert not torch.allclose(kl.kl(logprobs, ref, "k2", 10.0), torch.tensor(verl["k2"], dtype=torch.float64))
    # low_var_kl's gradient flows where verl's does (inside both clamps) and is 0 where it is clamped
    lp = logprobs.clone().requires_grad_(True)
    kl.kl(lp, ref, "low_var_kl", None).sum().backward()
    inside = [abs(_verl_low_var_kl(g, 0.0)) < 10 for g in gaps]
    assert all((float(grad) != 0) == flag for grad, flag in zip(lp.grad, inside))


def test_entropy_reference_matches_loop():
    """The entropy formula tests/test_algos_vocab_parallel.py checks the sharded entropy against."""
    logits = _rand(3, 4, 11, seed=10, scale=4.0)
    got = entropy_from_logits(logits)
    assert got.shape == (3, 4)
    for i in range(3):
        for j in range(4):
            row = [float(v) for v in logits[i, j]]
            z = sum(math.exp(v) for v in row)
            want = -sum(math.exp(v) / z * math.log(math.exp(v) / z) for v in row)
            assert abs(float(got[i, j]) - want) < 1e-12


def test_clipped_value_loss_matches_loop():
    mask = _mask()
    old, returns = _rand(B, T, seed=11), _rand(B, T, seed=12)
    values = old + _rand(B, T, seed=13, scale=0.4)
    loss, clipped = clipped_value_loss(values, old, returns, mask, eps_clip=0.2)
    want_loss, want_clipped = _grid(), _grid()
    for i, t in _tokens(mask):
        v, o, r = float(values[i, t]), float(old[i, t]), float(returns[i, t])
        plain, cut = (v - r) ** 2, (min(max(v, o - 0.2), o + 0.2) - r) ** 2
        want_loss[i][t], want_clipped[i][t] = 0.5 * max(plain, cut), float(cut > plain)
    _check(loss, want_loss, mask)
    _check(clipped, want_clipped, mask)
    assert 0 < clipped.sum() < mask.sum()


def _ref_aggregate(loss, mask, mode, max_len):
    seqs = []
    for i in range(loss.shape[0]):
        seqs.append([float(loss[i, t]) for t in range(loss.shape[1]) if mask[i, t]])
    if mode == "token-mean":
        flat = [v for seq in seqs for v in seq]
        return sum(flat) / len(flat)
    per_seq = {
        "seq-mean-token-sum": lambda seq: sum(seq),
        "seq-mean-token-mean": lambda seq: sum(seq) / len(seq) if seq else 0.0,
        "seq-mean-token-sum-norm": lambda seq: sum(seq) / max_len,
    }[mode]
    return sum(per_seq(seq) for seq in seqs) / len(seqs)


def _splits(b, rng):
    """Ways to cut b rows into micro-batches (DP ranks x micro-batches flatten to a partition)."""
    yield [list(range(b))]
    yield [[i] for i in range(b)]
    for _ in range(4):
        order = list(range(b))
        rng.shuffle(order)
        cuts = sorted(rng.sample(range(1, b), rng.randint(1, b - 2)))
        yield [order[s:e] for s, e in zip([0] + cuts, cuts + [b])]


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean",
                                  "seq-mean-token-sum-norm"])
def test_aggregation_matches_loop_and_is_split_invariant(mode):
    b, max_len = 12, 16
    lengths = [16, 1, 5, 0, 9, 12, 3, 16, 7, 2, 11, 4]
    mask = torch.tensor([[t < n for t in range(max_len)] for n in lengths])
    loss = torch.where(mask, _rand(b, max_len, seed=14), float("nan"))
    want = _ref_aggregate(loss, mask, mode, max_len)
    tokens, seqs = mask.sum(), b
    whole = aggregate(loss, mask.double(), mode, tokens, seqs, max_len)
    assert abs(float(whole) - want) < 1e-12
    for parts in _splits(b, random.Random(mode)):
        total = sum(aggregate(loss[rows], mask[rows], mode, tokens, seqs, max_len) for rows in parts)
        assert abs(float(total) - want) < 1e-12, parts


def test_aggregation_modes_differ_and_unknown_mode_is_named():
    mask = _mask()
    loss = _rand(B, T, seed=15).abs()
    values = {mode: float(aggregate(loss, mask, mode, mask.sum(), B, T)) for mode in AGGREGATIONS}
    assert len(set(values.values())) == 4
    with pytest.raises(ValueError, match=r"'token_mean'.*'seq-mean-token-mean'"):
        aggregate(loss, mask, "token_mean", mask.sum(), B, T)
