"""On-policy distillation's pure parts against references written from the definitions in python
floats: the per-token term advantage_t += -coeff * (log pi_s(y_t) - log pi_t(y_t)) on the model's
own tokens only (no discounting; after the estimator's whitening; the critic's returns the
reward's), with and without a reward, over fuzzed shapes and multi-turn masks with holes; the
distill/* metrics; and the teacher's top-1 match against torch.argmax on the full logits, the
output layer's padding excluded (at TP2: tests/test_algos_vocab_parallel.py's gloo launch)."""

import random

import pytest
import torch

from megarl.algos.advantages import ADVANTAGE_ESTIMATORS, WHITENED_BY_DEFAULT
from megarl.algos.distill import distill_advantages, distill_metrics
from megarl.algos.vocab_parallel import top1_match
from megarl.planning.config import AlgoConfig
from megarl.teacher.config import DistillConfig
from megarl.trainer.loop import with_advantages
from tests.test_algos_advantage_step import MAX_NEW, _batch, _close, _inputs, _reference, _step

COEFF = 0.7


def _teacher(inputs, seed=5):
    """Teacher log-probs of the sampled tokens: NaN off the mask, as the estimators' inputs are."""
    g = torch.Generator().manual_seed(seed)
    mask = inputs["mask"].bool()
    return torch.where(mask, -torch.rand(mask.shape, generator=g, dtype=torch.float64) * 3, float("nan"))


def _ref_term(student, teacher, mask, coeff):
    """-coeff * (log pi_s - log pi_t) on each masked-in token, 0 elsewhere: python floats."""
    out = torch.zeros(mask.shape, dtype=torch.float64)
    for i in range(mask.shape[0]):
        for t in range(mask.shape[1]):
            if mask[i, t]:
                out[i, t] = -coeff * (float(student[i, t]) - float(teacher[i, t]))
    return out


@pytest.mark.parametrize("estimator", sorted(ADVANTAGE_ESTIMATORS))
def test_the_term_adds_to_every_estimator_after_its_whitening(estimator):
    """The estimator's advantages (whitened where it whitens) plus the term; the critic's returns
    are the reward's alone. Added before whitening, the term would be rescaled: the reference
    would differ by far more than the tolerance."""
    inputs = _inputs()
    teacher = _teacher(inputs)
    whiten = WHITENED_BY_DEFAULT[estimator]
    plain, plain_returns = _step(inputs, estimator)
    advantages, returns = _step(inputs, estimator, teacher_logprobs=teacher, distill_coeff=COEFF)
    term = _ref_term(inputs["logprobs"], teacher, inputs["mask"], COEFF)
    assert term.abs().max() > 0.5
    _close(advantages, _reference(inputs, estimator, whiten)[0] + term)
    torch.testing.assert_close(returns, plain_returns, rtol=0, atol=0, equal_nan=True)
    _close(advantages - plain, term, tol=1e-12)


def test_pure_distillation_is_the_term_alone():
    """algo.reward none with GRPO: every reward 0, so the estimator's part is exactly 0 and a run's
    float32 batch trains on the term alone (loop.with_advantages, as a step calls it)."""
    inputs = {**_inputs(), "rewards": torch.zeros(10, dtype=torch.float64)}
    assert torch.equal(_step(inputs, "grpo")[0], torch.zeros_like(inputs["mask"]))
    teacher = _teacher(inputs)
    batch = _batch(inputs).with_fields(
        teacher_logprobs=torch.where(inputs["mask"].bool(), teacher, 0).float())
    distilled = AlgoConfig(advantage="grpo", distill=DistillConfig(coeff=COEFF))
    trained = with_advantages(batch, distilled, MAX_NEW)
    want = _ref_term(batch.old_logprobs.double(), batch.teacher_logprobs.double(), inputs["mask"], COEFF)
    assert trained.advantages.dtype == torch.float32
    _close(trained.advantages.double(), want, tol=1e-6)
    # coeff 0 (the default): no term, whatever the batch carries
    off = with_advantages(batch, AlgoConfig(advantage="grpo"), MAX_NEW)
    assert torch.equal(off.advantages, torch.zeros_like(off.advantages))


def _holey_mask(rng: random.Random, b: int, t: int) -> torch.Tensor:
    """Multi-turn loss masks: a prompt, then turns of the model's tokens with inserted text (tool
    outputs, 0 in the mask) between them, then padding; some rows empty."""
    mask = torch.zeros(b, t)
    for i in range(b):
        position = rng.randrange(0, t)
        while position < t and rng.random() < 0.8:
            turn = rng.randrange(1, 6)
            mask[i, position:position + turn] = 1
            position += turn + rng.randrange(1, 5)
    return mask


@pytest.mark.parametrize("seed", range(6))
def test_fuzzed_shapes_and_holey_masks_against_the_reference(seed):
    """Random sizes, masks with holes and coefficients: the term is on the masked-in tokens alone
    (a tool output's tokens keep their advantage exactly, whatever the log-probs there hold, NaN
    and inf included), and the metrics are the means over those tokens."""
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    b, t = rng.randrange(1, 9), rng.randrange(1, 40)
    mask = _holey_mask(rng, b, t)
    keep = mask.bool()
    student = -torch.rand(b, t, generator=g, dtype=torch.float64) * 4
    teacher = -torch.rand(b, t, generator=g, dtype=torch.float64) * 4
    top1 = (torch.rand(b, t, generator=g) < 0.4).float()
    advantages = torch.randn(b, t, generator=g, dtype=torch.float64)
    # what an unmasked position may hold: the teacher scored inserted text and padding too
    junk = torch.tensor([float("nan"), float("inf"), -float("inf"), 1e30])
    teacher_junk = torch.where(keep, teacher, junk[torch.randint(0, 4, (b, t), generator=g)].double())
    coeff = rng.choice([1e-3, 0.5, 1.0, 3.0])
    got = distill_advantages(advantages, student, teacher_junk, mask, coeff)
    _close(got, advantages + _ref_term(student, teacher, mask, coeff), tol=1e-12)
    assert torch.equal(got[~keep], advantages[~keep])

    metrics = distill_metrics(student.float(), teacher_junk.float(), top1, mask)
    pairs = [(float(student[i, j]), float(teacher[i, j]), float(top1[i, j]))
             for i in range(b) for j in range(t) if mask[i, j]]
    n = len(pairs)
    want = {"distill/reverse_kl": sum(s - te for s, te, _ in pairs) / n if n else 0.0,
            "distill/teacher_logprob": sum(te for _, te, _ in pairs) / n if n else 0.0,
            "distill/teacher_top1_match": sum(m for _, _, m in pairs) / n if n else 0.0}
    assert set(metrics) == set(want)
    for name, value in want.items():  # float32 log-probs, summed in float64
        assert float(metrics[name]) == pytest.approx(value, abs=1e-6), (name, seed)


def test_a_batch_without_tokens_has_zero_metrics():
    empty = torch.zeros(2, 3)
    metrics = distill_metrics(torch.ones(2, 3), torch.full((2, 3), float("nan")), torch.ones(2, 3), empty)
    assert {k: float(v) for k, v in metrics.items()} == {
        "distill/reverse_kl": 0.0, "distill/teacher_logprob": 0.0, "distill/teacher_top1_match": 0.0}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_top1_match_is_argmax_over_the_real_vocabulary(dtype):
    """Without a group (TP1): whether the target is torch.argmax of the logits' real columns; the
    output layer's padding (columns >= vocab_size) is never the top-1, however large. Half the
    targets are the argmax, so both answers occur."""
    g = torch.Generator().manual_seed(0)
    n, padded, vocab = 64, 24, 19
    logits = (torch.randn(n, padded, generator=g, dtype=torch.float64) * 4).to(dtype)
    logits[:, vocab:] = 100.0
    best = logits[:, :vocab].float().argmax(-1)
    targets = torch.where(torch.rand(n, generator=g) < 0.5, best, torch.randint(0, vocab, (n,), generator=g))
    got = top1_match(logits, targets, None, vocab)
    assert got.dtype == torch.bool
    assert torch.equal(got, targets == best) and 0 < int(got.sum()) < n
    # a tie with the top counts as a match: both tied tokens are a greedy choice
    tied = logits.clone()
    tied[0, (int(best[0]) + 1) % vocab] = tied[0, int(best[0])]
    assert top1_match(tied[:1], torch.tensor([(int(best[0]) + 1) % vocab]), None, vocab).item()
