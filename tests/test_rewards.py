"""Rewards: the math-verify reward on a table of answer pairs, reward functions with megarl's and
verl's signatures (sync, async, dict results), a function per data source, and the scoring pool:
failures and timeouts count and score 0, a hanging function is cut, a dying worker is replaced."""

import asyncio
import os
import time

import pytest
import torch

from megarl.rewards.builtin import exact_match, math_reward
from megarl.rewards.functions import Request, RewardFunction, RewardTable
from megarl.rewards.pool import scoring_pool
from megarl.rewards.scorer import Scorer, combine
from megarl.rewards.spec import parse_spec

# (response, ground truth as a dataset holds it, expected verdict)
MATH_CASES = [
    # integers, formatting, markers
    ("#### 1,000", "1000", 1.0), ("The answer is 17.", "17", 1.0), ("5", "5", 1.0),
    ("I think 3, then 5, finally 12", "12", 1.0), ("#### 7", "8", 0.0), ("15", "5", 0.0),
    ("nothing", "3", 0.0), (" What", "5", 0.0), ("-4", "-4", 1.0), ("#### -4", "4", 0.0),
    # \boxed
    (r"so \boxed{42}.", "42", 1.0), (r"\boxed{41}", "42", 0.0), (r"\boxed{\dfrac{3}{4}}", "0.75", 1.0),
    # fractions and decimals
    ("the answer is 0.5", "1/2", 1.0), (r"\boxed{\frac{1}{2}}", r"\frac12", 1.0),
    (r"\boxed{\frac{2}{4}}", r"\frac{1}{2}", 1.0), (r"\boxed{\frac{1}{3}}", "0.33", 0.0),
    (r"\boxed{0.3333333}", r"\frac{1}{3}", 1.0), (r"\boxed{\frac{3}{2}}", r"1\frac{1}{2}", 1.0),
    # expressions, roots, pi
    (r"\boxed{x+1}", "x + 1", 1.0), (r"\boxed{1+x}", "x+1", 1.0), (r"\boxed{x-1}", "x+1", 0.0),
    (r"\boxed{2\sqrt{2}}", r"\sqrt{8}", 1.0), (r"\boxed{\sqrt{3}}", r"\sqrt{2}", 0.0),
    (r"\boxed{2\pi}", r"2\pi", 1.0), (r"\boxed{\pi}", "3", 0.0), (r"\boxed{x^2+2x+1}", "(x+1)^2", 1.0),
    # percentages and units
    ("= 25%", "25", 1.0), (r"\boxed{25\%}", "25", 1.0), (r"\boxed{30\%}", "25", 0.0),
    (r"\boxed{5 \text{ cm}}", "5", 1.0), (r"\boxed{12\text{ dollars}}", "12", 1.0),
    (r"\boxed{\$18}", "18", 1.0), (r"\boxed{90^\circ}", "90", 1.0),
    # sets, tuples and intervals
    (r"\boxed{[1,2)}", "[1,2)", 1.0), (r"\boxed{(1,2)}", "[1,2)", 0.0),
    (r"\boxed{\{1, 2\}}", r"\{2,1\}", 1.0),
    (r"\boxed{(-\infty, 3]}", r"(-\infty,3]", 1.0), (r"\boxed{(3, 4)}", "(3,4)", 1.0),
    # several boxed answers are their set (the old extractor took the last one)
    (r"\boxed{3} no wait \boxed{4}", "4", 0.0),
    # equations and LaTeX spacing
    (r"\boxed{x = 3}", "3", 1.0), (r"$\boxed{ 7 }$", "7", 1.0),
]


@pytest.mark.parametrize("response,truth,verdict", MATH_CASES)
def test_math_reward(response, truth, verdict):
    assert math_reward(response, truth) == verdict


def test_the_table_is_large_and_mixed():
    assert len(MATH_CASES) >= 40 and {v for *_, v in MATH_CASES} == {0.0, 1.0}


def megarl_style(response, truth):
    return float(response == truth)


def verl_style(data_source, solution_str, ground_truth, extra_info=None):
    return {"score": float(solution_str == ground_truth), "acc": solution_str == ground_truth,
            "length": len(solution_str), "pred": solution_str, "source_is_a": data_source == "a",
            "index": extra_info["index"]}


def verl_no_extra(data_source, solution_str, ground_truth):
    return 2.0


async def verl_async(data_source, solution_str, ground_truth, extra_info, **kwargs):
    await asyncio.sleep(0)
    return 3.0 if extra_info.get("bonus") else 1.0


def broken(response, truth):
    if response == "boom":
        raise RuntimeError("kaput")
    if response == "die":
        os._exit(3)
    if response == "hang":
        time.sleep(3600)
    return {"nan": float("nan"), "text": "1", "nodict": {"score_": 1}}.get(response, 1.0)


def three(a, b, c):
    return 0.0


def test_signatures_are_told_apart_and_called_as_written():
    megarl = RewardFunction("tests.test_rewards:megarl_style")
    verl = RewardFunction("tests.test_rewards:verl_style")
    assert not megarl.verl and verl.verl
    assert megarl(Request("7", "7")).score == 1.0
    assert megarl(Request('[1, 2]', [1, 2])).score == 1.0  # a non-string ground truth as its JSON
    outcome = verl(Request("42", "42", "a", {"index": 5}))
    assert outcome.score == 1.0
    # numbers (bools as 0/1) become extras; text does not
    assert outcome.extras == {"acc": 1.0, "length": 2.0, "source_is_a": 1.0, "index": 5.0}
    assert RewardFunction("tests.test_rewards:verl_no_extra")(Request("x", "y", "s", {"i": 1})).score == 2.0
    asynchronous = RewardFunction("tests.test_rewards:verl_async")
    assert asynchronous(Request("x", "y", "s", {"bonus": 1})).score == 3.0
    assert RewardFunction("exact_match")(Request(" a ", "a")).score == exact_match("a", "a") == 1.0
    with pytest.raises(ValueError, match=r"'tests.test_rewards:three' takes \(a, b, c\); write megarl's"):
        RewardFunction("tests.test_rewards:three")
    with pytest.raises(ValueError, match="neither built in"):
        RewardFunction("nope")
    with pytest.raises(ValueError, match="cannot load 'missing' from module 'tests.test_rewards'"):
        RewardFunction("tests.test_rewards:missing")


def test_a_function_per_data_source():
    table = RewardTable("exact_match", {"a": "tests.test_rewards:verl_no_extra"})
    assert table.spec_for("a").functions == ("tests.test_rewards:verl_no_extra",)
    assert table.spec_for("b").functions == ("exact_match",)
    table.check()
    with pytest.raises(ValueError, match="'tests.test_rewards:three' takes"):
        RewardTable("math", {"x": "tests.test_rewards:three"}).check()
    pool = scoring_pool(0, 1.0)
    jobs = [(table.spec_for(s).functions[0], Request("x", "x", s)) for s in ("a", "b", "c")]
    scores = summarized(jobs, pool.map(jobs))
    assert scores.rewards.tolist() == [2.0, 1.0, 1.0]


def summarized(jobs, results):
    """Scores of one-function rewards: job i is sample i's only term."""
    return combine([parse_spec(name) for name, _ in jobs],
                   {(i, name): r for i, ((name, _), r) in enumerate(zip(jobs, results))}, {})


@pytest.mark.parametrize("workers", [0, 2])
def test_failures_score_zero_and_are_counted(workers):
    pool = scoring_pool(workers, timeout_s=30, preload=["tests.test_rewards:broken"])
    try:
        jobs = [("tests.test_rewards:broken", Request(r, ""))
                for r in ("ok", "boom", "nan", "text", "nodict", "ok")]
        scores = summarized(jobs, pool.map(jobs))
    finally:
        pool.close()
    assert torch.equal(scores.rewards, torch.tensor([1.0, 0.0, 0.0, 0.0, 0.0, 1.0]))
    assert scores.failures == 4 and scores.timeouts == 0 and scores.first_error == "RuntimeError: kaput"


def test_hanging_and_dying_functions_are_cut_and_their_workers_replaced():
    pool = scoring_pool(2, timeout_s=2.0,
                       preload=["tests.test_rewards:broken", "tests.test_rewards:verl_style"])
    try:
        start = time.monotonic()
        jobs = [("tests.test_rewards:broken", Request(r, "")) for r in ("hang", "ok", "die", "ok", "ok")]
        results = pool.map(jobs)
        took = time.monotonic() - start
        again = pool.map([("tests.test_rewards:verl_style", Request("1", "1", "a", {"index": i}))
                          for i in range(4)])
    finally:
        pool.close()
    assert took < 2.0 + 10  # cut at its timeout (plus a replacement worker's start), not an hour
    assert results[0].timed_out and results[0].error == "timed out after 2 s"
    assert results[2].error == "worker died (exit code 3)" and not results[2].timed_out
    assert [r.value.score for r in (results[1], results[3], results[4])] == [1.0, 1.0, 1.0]
    scores = summarized(jobs, results)
    assert scores.failures == 2 and scores.timeouts == 1
    assert [r.value.extras["index"] for r in again] == [0.0, 1.0, 2.0, 3.0]  # in order, by new workers


def test_extras_are_per_sample_with_nan_where_missing():
    table = RewardTable("tests.test_rewards:verl_style", {"m": "tests.test_rewards:megarl_style"})
    scores = Scorer(table, 0, 1.0).score([Request("1", "1", "a", {"index": 4}), Request("1", "2", "m"),
                                          Request("3", "1", "b", {"index": 6})], [[1, 2]] * 3)
    assert scores.rewards.tolist() == [1.0, 0.0, 0.0]
    assert set(scores.extras) == {"acc", "length", "source_is_a", "index"}
    index = scores.extras["index"]
    assert index[0] == 4 and torch.isnan(index[1]) and index[2] == 6


VERL_FILE = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return {"score": float(solution_str == ground_truth), "hits": 1}
'''


def test_a_reward_file_outside_any_package_as_verl_names_it(tmp_path, monkeypatch):
    """verl's custom_reward_function.path is a file: 'path/to/file.py:function', also relative to
    the directory the run starts in, also in the pool's workers."""
    (tmp_path / "my_reward.py").write_text(VERL_FILE)
    monkeypatch.chdir(tmp_path)
    for name in (str(tmp_path / "my_reward.py:compute_score"), "my_reward.py:compute_score"):
        assert RewardFunction(name)(Request("4", "4", "s", {})).score == 1.0
    pool = scoring_pool(1, 30, preload=["my_reward.py:compute_score"])
    try:
        (result,) = pool.map([("my_reward.py:compute_score", Request("4", "5", "s", {}))])
    finally:
        pool.close()
    assert result.value.score == 0.0 and result.value.extras == {"hits": 1.0}
    with pytest.raises(ValueError, match=r"'missing.py:f': file '.*missing.py' does not exist"):
        RewardFunction("missing.py:f")
