"""Held-out metrics: the unbiased pass@k against math.comb's formula on random counts, the
aggregation per set and data source on hand-made samples, the console line, and the run's log and
picture holding an at-start evaluation's row (no reward) beside the steps' rows."""

import json
import math
import random

import pytest

from megarl.evaluation.eval_metrics import EvalRow, aggregate, source_names, summary
from megarl.evaluation.pass_at_k import pass_at_k
from megarl.trainer.metrics import MetricsLog
from megarl.trainer.plots import plot_run


def _reference(n: int, c: int, k: int) -> float:
    """The estimator as the Codex paper writes it, in exact integers."""
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def test_pass_at_k_matches_the_binomial_formula_on_random_counts():
    rng = random.Random(0)
    for _ in range(200):
        n = rng.randint(1, 300)
        c, k = rng.randint(0, n), rng.randint(1, n)
        assert pass_at_k(n, c, k) == pytest.approx(_reference(n, c, k), abs=1e-12), (n, c, k)
    # The product form stays finite where the binomials overflow a float (C(2000, 1000) ~ 1e600).
    assert pass_at_k(2000, 3, 1000) == pytest.approx(_reference(2000, 3, 1000), abs=1e-12)


def test_pass_at_k_edges_and_refusals():
    assert pass_at_k(8, 0, 1) == 0.0 and pass_at_k(8, 0, 8) == 0.0
    assert pass_at_k(8, 8, 1) == 1.0 and pass_at_k(8, 1, 8) == 1.0  # k = n draws every sample
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25) and pass_at_k(4, 2, 3) == 1.0  # n - c < k
    with pytest.raises(ValueError, match=r"n=4 samples, c=1 correct, k=5: .*eval.samples >= every"):
        pass_at_k(4, 1, 5)
    for n, c, k in ((4, 5, 1), (4, -1, 1), (4, 1, 0)):
        with pytest.raises(ValueError, match=f"n={n} samples, c={c} correct, k={k}"):
            pass_at_k(n, c, k)


def _rows():
    """Set `math`: source gsm8k/main, prompt 0 (2 of 4 correct) and prompt 1 (0 of 4), source ""
    prompt 2 (4 of 4, one truncated); set `code`: one prompt, 1 of 4."""
    rows = []
    for prompt, source, rewards in ((0, "openai/gsm8k", [1, 0, 1, 0.5]), (1, "openai/gsm8k", [0, 0, 0.2, 0]),
                                    (2, "", [1, 1, 0.9, 1])):
        rows += [EvalRow("math", source, prompt, r, 2 + i, prompt == 2 and i == 0)
                 for i, r in enumerate(rewards)]
    rows += [EvalRow("code", "mbpp", 0, r, 10, False) for r in (0, 0, 1, 0)]
    return rows


def test_aggregation_per_set_and_source():
    got = aggregate(_rows(), pass_k=(1, 2, 4), threshold=0.5)
    gsm = {k.split("/")[-1]: v for k, v in got.items() if k.startswith("eval/math/openai_gsm8k/")}
    assert gsm == pytest.approx({
        "reward_mean": 2.7 / 8, "accuracy": 2 / 8,  # reward 0.5 is not above the threshold
        "pass@1": (2 / 4 + 0) / 2, "pass@2": (_reference(4, 2, 2) + 0) / 2, "pass@4": (1 + 0) / 2,
        "response_len_mean": 3.5, "truncation_rate": 0.0})
    assert got["eval/math/default/accuracy"] == 1.0 and got["eval/math/default/truncation_rate"] == 0.25
    whole = {k.split("/")[-1]: v for k, v in got.items() if k.startswith("eval/math/all/")}
    assert whole == pytest.approx({
        "reward_mean": (2.7 + 3.9) / 12, "accuracy": 6 / 12, "pass@1": (0.5 + 0 + 1) / 3,
        "pass@2": (_reference(4, 2, 2) + 0 + 1) / 3, "pass@4": 2 / 3, "response_len_mean": 3.5,
        "truncation_rate": 1 / 12})
    assert got["eval/code/mbpp/pass@4"] == 1.0 and got["eval/code/all/pass@1"] == 0.25
    assert len(got) == 7 * 5  # math: gsm8k, default, all; code: mbpp, all
    # one sample a prompt: pass@1 is the accuracy
    single = aggregate([EvalRow("s", "", i, float(i % 3 == 0), 1, False) for i in range(9)], (1,), 0.5)
    assert single["eval/s/all/pass@1"] == single["eval/s/all/accuracy"] == 3 / 9


def test_a_prompt_with_fewer_samples_than_k_is_refused():
    with pytest.raises(ValueError, match=r"n=1 samples, c=1 correct, k=2"):
        aggregate([EvalRow("s", "", 0, 1.0, 1, False)], pass_k=(2,), threshold=0.5)


def test_source_names_are_tensorboard_safe_and_never_collide():
    assert source_names(["openai/gsm8k", "", "lighteval/MATH level 5"]) == {
        "": "default", "openai/gsm8k": "openai_gsm8k", "lighteval/MATH level 5": "lighteval_MATH_level_5"}
    with pytest.raises(ValueError, match=r"\['a/b', 'a_b'\] would be reported under one name 'a_b'"):
        source_names(["a_b", "a/b"])
    with pytest.raises(ValueError, match=r"under one name 'all' \(the whole set\)"):
        source_names(["all"])


def test_summary_names_each_set_s_accuracy_and_pass_at_k():
    got = summary(aggregate(_rows(), pass_k=(1, 4), threshold=0.5), step=7)
    assert got == ["megarl: held-out code: accuracy 0.250, pass@1 0.250, pass@4 1.000, mean reward 0.250 "
                   "(step 7)",
                   "megarl: held-out math: accuracy 0.500, pass@1 0.500, pass@4 0.667, mean reward 0.550 "
                   "(step 7)"]


def test_the_log_and_curves_take_an_at_start_evaluation_row(tmp_path):
    """Step 0 holds evaluation metrics only; the reward trend reads the steps' rows, the curves
    get the held-out panels, TensorBoard every key."""
    log = MetricsLog(str(tmp_path), total_steps=2, first_step=1, enabled=True)
    at_start = aggregate(_rows(), (1,), 0.5)
    log.log(0, at_start, trained=False)
    log.log(1, {"reward/mean": 0.25, "time/generate": 1.0})
    last = {**aggregate(_rows()[:4], (1,), 0.5), "time/eval": 0.5}
    log.log(2, {"reward/mean": 0.75, "time/generate": 1.0, **last})
    log.close()
    assert log.reward_window(first=True) == 0.25 and log.reward_window(first=False) == 0.75
    assert [step for step, _ in log.evaluations()] == [0, 2]
    assert log.evaluations()[1][1] == {k: v for k, v in last.items() if k.startswith("eval/")}
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows[0] == {"step": 0, **at_start}
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [e.step for e in events.Scalars("eval/math/openai_gsm8k/accuracy")] == [0, 2]
    import matplotlib.image
    assert matplotlib.image.imread(plot_run(str(tmp_path))).shape[1] == 20 * 80  # four columns of panels
