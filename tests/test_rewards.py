"""Rewards: answer extraction and comparison cases, user functions, failures counted not raised."""

import pytest
import torch

from megarl.rollout.rewards import exact_match, extract_final_answer, load_reward_fn, math_verify, score


@pytest.mark.parametrize("text,answer", [
    (r"so the result is \boxed{\frac{1}{2}} indeed", r"\frac{1}{2}"),
    (r"\boxed{3} no wait \boxed{4}", "4"),
    ("step 1: 2+2=4\n#### 4", "4"),
    ("The answer is 17.", "17"),
    ("I think 3, then 5, finally 12", "12"),
    ("no digits here", None),
])
def test_extract_final_answer(text, answer):
    assert extract_final_answer(text) == answer


@pytest.mark.parametrize("response,truth,reward", [
    ("#### 1,000", "1000", 1.0),
    ("the answer is 0.5", "1/2", 1.0),
    (r"\boxed{x+1}", "x + 1", 1.0),
    ("#### 7", "8", 0.0),
    ("nothing", "3", 0.0),
    ("= 25%", "25", 1.0),
])
def test_math_verify(response, truth, reward):
    assert math_verify(response, truth) == reward


def broken(response, truth):
    if response == "boom":
        raise RuntimeError("kaput")
    return float("nan") if response == "nan" else 1.0


def test_user_functions_and_failures():
    assert load_reward_fn("math") is math_verify
    assert load_reward_fn("exact_match")(" a ", "a") == exact_match("a", "a") == 1.0
    fn = load_reward_fn("tests.test_rewards:broken")
    scores = score(fn, ["ok", "boom", "nan", "ok"], ["", "", "", ""])
    assert torch.equal(scores.rewards, torch.tensor([1.0, 0.0, 0.0, 1.0]))
    assert scores.failures == 2 and scores.first_error == "RuntimeError: kaput"
    with pytest.raises(ValueError, match="neither built in"):
        load_reward_fn("nope")
    with pytest.raises(ValueError, match="cannot load 'missing' from module 'tests.test_rewards'"):
        load_reward_fn("tests.test_rewards:missing")
