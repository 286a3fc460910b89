"""Rule-based rewards: a math verifier, exact match, and user functions named `module:function`.

Owns resolving a reward name to a function `(response: str, ground_truth: str) -> float` and
scoring a batch so that one failing sample never stops a run: a function that raises, or returns
something that is not a finite number, scores 0 and is counted.
Does not own shaping (DAPO's overlong penalty lives in algos) or KL penalties.
"""

import math
import re
from dataclasses import dataclass
from fractions import Fraction
from typing import Callable, List, Optional

import torch

from megarl.rollout.plugins import load_callable

RewardFn = Callable[[str, str], float]

_BOXED = re.compile(r"\\boxed\{")
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:/\d+)?|-?\.\d+")
_MARKERS = (re.compile(r"####\s*(.+)"), re.compile(r"answer is[:\s]*\$?([^\n$]+)", re.IGNORECASE))


def _last_boxed(text: str) -> Optional[str]:
    """Content of the last \\boxed{...}, braces balanced."""
    starts = [m.end() for m in _BOXED.finditer(text)]
    if not starts:
        return None
    depth, start = 1, starts[-1]
    for i in range(start, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[start:i]
    return None


def extract_final_answer(text: str) -> Optional[str]:
    """The answer a response commits to: the last \\boxed{}, else after '####' or 'answer is',
    else its last number. None when there is nothing to extract."""
    boxed = _last_boxed(text)
    if boxed is not None:
        return boxed.strip()
    for marker in _MARKERS:
        found = marker.findall(text)
        if found:
            return found[-1].strip().rstrip(".")
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else None


def _as_number(text: str) -> Optional[Fraction]:
    cleaned = text.strip().replace(",", "").replace("$", "").rstrip(".").strip()
    if cleaned.endswith("%"):
        cleaned = cleaned[:-1]
    try:
        return Fraction(cleaned)
    except (ValueError, ZeroDivisionError):
        return None


def math_verify(response: str, ground_truth: str) -> float:
    """1.0 when the extracted final answer equals the ground truth: numerically (1/2 == 0.5,
    1,000 == 1000) when both parse as numbers, else as whitespace-insensitive strings."""
    answer = extract_final_answer(response)
    if answer is None:
        return 0.0
    got, want = _as_number(answer), _as_number(ground_truth)
    if got is not None and want is not None:
        return float(got == want)
    return float("".join(answer.split()) == "".join(ground_truth.split()))


def exact_match(response: str, ground_truth: str) -> float:
    return float(response.strip() == ground_truth.strip())


REWARD_FUNCTIONS = {"math": math_verify, "exact_match": exact_match}


def load_reward_fn(name: str) -> RewardFn:
    """A built-in name, or 'package.module:function'."""
    return load_callable(name, REWARD_FUNCTIONS, "reward")


@dataclass(frozen=True)
class Scores:
    rewards: torch.Tensor  # [N] float32
    failures: int  # samples whose function raised or returned a non-number (scored 0)
    first_error: Optional[str]  # the first failure's message, for the log


def score(fn: RewardFn, responses: List[str], ground_truths: List[str]) -> Scores:
    if len(responses) != len(ground_truths):
        raise ValueError(f"{len(responses)} responses but {len(ground_truths)} ground truths")
    rewards, failures, first_error = [], 0, None
    for response, truth in zip(responses, ground_truths):
        try:
            value = float(fn(response, truth))
            if not math.isfinite(value):
                raise ValueError(f"reward is {value}")
        except Exception as error:  # a user's function must not end the run; counted instead
            value, failures = 0.0, failures + 1
            first_error = first_error or f"{type(error).__name__}: {error}"
        rewards.append(value)
    return Scores(torch.tensor(rewards, dtype=torch.float32), failures, first_error)
