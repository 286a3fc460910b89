"""Rollout corrections and mismatch statistics against loop references on random fp64 data with
padding: every preset and level, masks included, and the degenerate cases (everything rejected,
empty rows)."""

import math

import pytest
import torch

from megarl.algos import mismatch
from megarl.algos import policy_losses as pl
from megarl.algos import rollout_correction as rc
from megarl.algos.aggregation import aggregate

B, T = 7, 10
LENGTHS = [10, 4, 7, 0, 1, 9, 5]


def _data(seed=0, scale=0.4):
    g = torch.Generator().manual_seed(seed)
    mask = torch.tensor([[float(t < n) for t in range(T)] for n in LENGTHS], dtype=torch.float64)
    old = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3 - 0.05
    rollout = old + torch.randn(B, T, generator=g, dtype=torch.float64) * scale
    return old, rollout, mask


def _ref_log_ratio(old, rollout, mask, i, level):
    """The ratio's log for row i at `level`, by loops."""
    real = [t for t in range(T) if mask[i, t]]
    diffs = [float(old[i, t] - rollout[i, t]) for t in real]
    if level == "sequence":
        value = sum(diffs)
    elif level == "geometric":
        value = sum(diffs) / max(len(diffs), 1)
    return [min(max(value if level != "token" else d, -20.0), 20.0) for d in diffs], real


def _ref_apply(old, rollout, mask, c: rc.Correction):
    keep = [[False] * T for _ in range(B)]
    weights = [[0.0] * T for _ in range(B)]
    for i in range(B):
        for t in range(T):
            keep[i][t] = bool(mask[i, t])
        if c.reject:
            low, high = c.bounds
            values, real = _ref_log_ratio(old, rollout, mask, i, c.reject)
            for v, t in zip(values, real):
                keep[i][t] = math.log(low) <= v <= math.log(high)
        if c.weights:
            values, real = _ref_log_ratio(old, rollout, mask, i, c.weights)
            for v, t in zip(values, real):
                w = math.exp(v) if c.cap is None else min(math.exp(v), c.cap)
                weights[i][t] = w if keep[i][t] else 0.0
    return keep, weights


CASES = dict(rc.PRESETS, **{
    "token_rs": rc.Correction(reject="token", high=1.3),
    "seq_weights_geo_reject": rc.Correction(weights="sequence", reject="geometric", low=0.9, high=1.2),
    "token_weights_seq_reject_capped": rc.Correction(weights="token", cap=1.5, reject="sequence",
                                                     high=3.0),
})


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("scale", [0.05, 0.4])
def test_every_correction_matches_the_loop_reference(name, scale):
    old, rollout, mask = _data(seed=len(name), scale=scale)
    correction = CASES[name]
    got = rc.apply(old, rollout, mask, correction)
    keep, weights = _ref_apply(old, rollout, mask, correction)
    assert got.keep.tolist() == keep
    if correction.weights is None:
        assert got.weights is None
    else:
        assert torch.allclose(got.weights, torch.tensor(weights, dtype=torch.float64), rtol=0,
                              atol=1e-6 * max(1.0, max(max(r) for r in weights)))
        assert not got.weights.requires_grad


def test_presets_reject_and_truncate_what_they_say():
    old, rollout, mask = _data(seed=3, scale=1.0)
    for name, correction in rc.PRESETS.items():
        got = rc.apply(old, rollout, mask, correction)
        assert not bool((got.keep & ~mask.bool()).any()), name  # padding is never kept
        if correction.reject is None:
            assert torch.equal(got.keep, mask.bool()), name
        else:
            assert int(got.keep.sum()) < int(mask.sum()), f"{name} rejected nothing at scale 1.0"
        if correction.cap is not None:
            assert float(got.weights.max()) <= correction.cap, name
            if correction.reject is None:  # unrejected ratios above the cap exist at scale 1.0
                assert float(got.weights.max()) == correction.cap, name


def test_rejecting_everything_gives_a_zero_loss_and_no_nan():
    old, rollout, mask = _data(seed=5)
    rollout = old + 3.0  # every ratio is e^-3: outside any sane bounds
    for name in ("token_mis", "seq_mis", "icepop", "decoupled_geo_rs"):
        got = rc.apply(old, rollout, mask, rc.PRESETS[name])
        assert not bool(got.keep.any()), name
        logprobs = (old + 0.1).requires_grad_()
        loss, _ = pl.ppo(logprobs=logprobs, old_logprobs=old, advantages=torch.ones_like(old),
                         mask=got.keep, eps_clip_low=0.2, eps_clip_high=0.2, is_weights=got.weights)
        total = aggregate(loss, got.keep, "token-mean", global_tokens=got.keep.sum().clamp(min=1),
                          global_seqs=max(int(got.keep.any(-1).sum()), 1), max_len=T)
        total.backward()
        assert float(total.detach()) == 0.0, name
        assert torch.isfinite(logprobs.grad).all() and not logprobs.grad.any(), name


def test_summary_counts_masked_and_truncated_tokens():
    old, rollout, mask = _data(seed=7, scale=1.0)
    correction = rc.Correction(weights="token", cap=1.5, reject="token", low=0.2, high=4.0)
    out = rc.summary(old, rollout, mask, correction)
    ratios = [math.exp(float(old[i, t] - rollout[i, t])) for i in range(B) for t in range(T)
              if mask[i, t]]
    kept = [r for r in ratios if 0.2 <= r <= 4.0]
    assert out["correction/masked_fraction"] == pytest.approx(1 - len(kept) / len(ratios), abs=1e-12)
    assert out["correction/truncated_fraction"] == pytest.approx(
        sum(r > 1.5 for r in kept) / len(kept), abs=1e-12)
    assert out["correction/weight_mean"] == pytest.approx(
        sum(min(r, 1.5) for r in kept) / len(kept), abs=1e-9)


@pytest.mark.parametrize("bad, message", [
    (dict(weights="tokens"), "weights='tokens'"),
    (dict(reject="seq", high=2.0), "reject='seq'"),
    (dict(cap=2.0), "cap=2.0 needs weights"),
    (dict(weights="token", cap=0.0), "cap=0.0"),
    (dict(high=2.0), "need reject"),
    (dict(reject="token"), "needs high"),
    (dict(reject="token", low=1.5, high=2.0), "0 < low <= 1 <= high"),
])
def test_bad_corrections_are_refused_by_name(bad, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("[", r"\[")):
        rc.Correction(**bad)


def test_logprob_mismatch_matches_loops():
    old, rollout, mask = _data(seed=11, scale=0.3)
    out = mismatch.logprob_mismatch(old, rollout, mask)
    diffs = [float(old[i, t] - rollout[i, t]) for i in range(B) for t in range(T) if mask[i, t]]
    mags = sorted(abs(d) for d in diffs)
    assert out["mismatch/kl_k1"] == pytest.approx(-sum(diffs) / len(diffs), abs=1e-12)
    assert out["mismatch/kl_k3"] == pytest.approx(
        sum(math.exp(d) - 1 - d for d in diffs) / len(diffs), abs=1e-12)
    assert out["mismatch/logprob_diff_max"] == pytest.approx(mags[-1], abs=1e-12)

    def quantile(q):  # linear interpolation, as torch.quantile
        pos = q * (len(mags) - 1)
        lo = int(math.floor(pos))
        return mags[lo] + (mags[min(lo + 1, len(mags) - 1)] - mags[lo]) * (pos - lo)
    assert out["mismatch/logprob_diff_p50"] == pytest.approx(quantile(0.5), abs=1e-12)
    assert out["mismatch/logprob_diff_p99"] == pytest.approx(quantile(0.99), abs=1e-12)
    rows = [[float(old[i, t] - rollout[i, t]) for t in range(T) if mask[i, t]] for i in range(B)]
    rows = [r for r in rows if r]
    assert out["mismatch/seq_logprob_gap_max"] == pytest.approx(max(abs(sum(r)) for r in rows), abs=1e-12)
    assert out["mismatch/seq_logprob_gap_mean"] == pytest.approx(
        sum(abs(sum(r)) for r in rows) / len(rows), abs=1e-12)
    assert out["mismatch/ppl_ratio"] == pytest.approx(
        sum(math.exp(-sum(r) / len(r)) for r in rows) / len(rows), abs=1e-12)
    identical = mismatch.logprob_mismatch(old, old, mask)
    assert identical["mismatch/kl_k3"] == 0 and identical["mismatch/logprob_diff_max"] == 0
    with pytest.raises(ValueError, match="without real tokens"):
        mismatch.logprob_mismatch(old, rollout, torch.zeros_like(mask))


def test_routing_mismatch_compares_sets_where_both_routed():
    g = torch.Generator().manual_seed(0)
    layers, k, experts = 3, 2, 8
    engine = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(B * T * layers)])
    engine = engine.view(B, T, layers, k).to(torch.int32)
    trainer = engine.flip(-1).clone()  # same sets, other order: not a difference
    trainer[0, 1, 2] = torch.tensor([engine[0, 1, 2, 0], (engine[0, 1, 2, 1] + 1) % experts])
    if set(trainer[0, 1, 2].tolist()) == set(engine[0, 1, 2].tolist()):
        trainer[0, 1, 2, 1] = (trainer[0, 1, 2, 1] + 1) % experts
    trainer[2, 3, 0, 0] = (engine[2, 3, 0, 0] + 3) % experts
    if trainer[2, 3, 0, 0] == engine[2, 3, 0, 1]:
        trainer[2, 3, 0, 0] = (trainer[2, 3, 0, 0] + 1) % experts
    engine[:, :, 1] = -1  # a dense layer: nobody routed
    trainer[4, 5] = -1  # a token the trainer never saw
    out = mismatch.routing_mismatch(engine, trainer)
    pairs = B * T * (layers - 1) - (layers - 1)
    assert out["routing/topk_diff_fraction"] == pytest.approx(2 / pairs)
    assert out["routing/tokens_diff_fraction"] == pytest.approx(2 / (B * T - 1))
    assert mismatch.routing_mismatch(engine, engine)["routing/topk_diff_fraction"] == 0
    with pytest.raises(ValueError, match="same shape"):
        mismatch.routing_mismatch(engine, engine[:, :-1])
