"""Built-in rule rewards, `(response, ground_truth) -> float`: `math` (the maintained math-verify
library: LaTeX and expression parsing, sympy equivalence) and `exact_match`.

math: the ground truth is read as the content of a \\boxed{} (as verl and NeMo-RL wrap it, so
"x + 1" or "\\frac{1}{2}" parse as math, not as their last number); the response is read as
math-verify extracts answers: \\boxed{}, "####", "the answer is", else its last expression.
Differences from the hand-written extractor it replaced (tests/test_rewards.py): a response with
several \\boxed{} answers is their set, not its last one; units and words after a number are
parsed by math-verify's rules.
"""

import threading

from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

_GOLD = [LatexExtractionConfig()]
_PREDICTION = [ExprExtractionConfig(), LatexExtractionConfig()]
_TIMEOUT_S = 5


def math_reward(response: str, ground_truth: str) -> float:
    # math-verify's own timeouts use SIGALRM, which only the main thread may set; elsewhere the
    # scoring pool's per-sample timeout bounds a call instead.
    timeout = _TIMEOUT_S if threading.current_thread() is threading.main_thread() else None
    gold = parse(f"\\boxed{{{ground_truth}}}", extraction_config=_GOLD, parsing_timeout=timeout)
    answer = parse(response, extraction_config=_PREDICTION, parsing_timeout=timeout)
    return float(bool(gold) and bool(answer) and verify(gold, answer, timeout_seconds=timeout))


def exact_match(response: str, ground_truth: str) -> float:
    return float(response.strip() == ground_truth.strip())


def no_reward(response: str, ground_truth: str) -> float:
    """`none`: every sample scores 0, for runs whose signal is elsewhere (pure on-policy
    distillation, algo.distill)."""
    return 0.0


BUILTIN = {"math": math_reward, "exact_match": exact_match, "none": no_reward}
