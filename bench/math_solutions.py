"""Long solutions as a reasoning model writes them (bench_rewards.py's real-work case): paragraphs
of steps with inline and display LaTeX, checks of intermediate values, and one \\boxed{} answer.

Each solution comes with its ground truth and whether its boxed answer is right. A right answer is
boxed in another form than the ground truth (an unreduced fraction, an unsimplified root, a
factored polynomial, a decimal), so math-verify must parse both and prove them equal with sympy,
not compare strings; a wrong one differs by a small amount in the same form.
"""

import math
import random
from typing import List, NamedTuple


class Solution(NamedTuple):
    response: str
    ground_truth: str  # as a dataset writes it (LaTeX, no \boxed)
    correct: bool  # whether the response's boxed answer equals the ground truth


def _fraction(rng: random.Random, correct: bool):
    a, b, c, d = rng.randint(1, 9), rng.randint(2, 12), rng.randint(1, 9), rng.randint(2, 12)
    num, den = a * d + c * b, b * d
    g = math.gcd(num, den)
    steps = [f"We add $\\frac{{{a}}}{{{b}}} + \\frac{{{c}}}{{{d}}}$ over the common denominator "
             f"${b} \\cdot {d} = {den}$:",
             f"\\[ \\frac{{{a}}}{{{b}}} + \\frac{{{c}}}{{{d}}} = "
             f"\\frac{{{a} \\cdot {d} + {c} \\cdot {b}}}{{{den}}} = \\frac{{{num}}}{{{den}}}. \\]",
             f"The greatest common divisor of ${num}$ and ${den}$ is ${g}$, which we may keep or divide out."]
    truth = f"\\frac{{{num // g}}}{{{den // g}}}"
    boxed = f"\\frac{{{num}}}{{{den}}}" if correct else f"\\frac{{{num + 1}}}{{{den}}}"
    return steps, truth, boxed


def _root(rng: random.Random, correct: bool):
    k, m = rng.randint(2, 9), rng.choice([2, 3, 5, 6, 7, 10, 11])
    steps = [f"Write ${k * k * m} = {k}^2 \\cdot {m}$, so that",
             f"\\[ \\sqrt{{{k * k * m}}} = \\sqrt{{{k}^2}} \\cdot \\sqrt{{{m}}} = {k}\\sqrt{{{m}}}. \\]",
             f"Squaring back, $({k}\\sqrt{{{m}}})^2 = {k * k} \\cdot {m} = {k * k * m}$, as it should."]
    truth = f"{k}\\sqrt{{{m}}}"
    boxed = f"\\sqrt{{{k * k * m}}}" if correct else f"\\sqrt{{{k * k * m + 1}}}"
    return steps, truth, boxed


def _square(rng: random.Random, correct: bool):
    a = rng.randint(2, 15)
    steps = [f"Expanding the square term by term, $(x + {a})^2 = x^2 + 2 \\cdot {a} x + {a}^2$.",
             f"\\begin{{align*}} (x+{a})^2 &= (x+{a})(x+{a}) \\\\ &= x^2 + {a}x + {a}x + {a * a} \\\\ "
             f"&= x^2 + {2 * a}x + {a * a}. \\end{{align*}}",
             f"At $x = 1$ both sides give ${(1 + a) ** 2}$, a quick check."]
    truth = f"x^2 + {2 * a}x + {a * a}"
    boxed = f"(x+{a})^2" if correct else f"(x+{a + 1})^2"
    return steps, truth, boxed


def _decimal(rng: random.Random, correct: bool):
    den = rng.choice([4, 5, 8, 16, 20, 25])
    num = rng.randint(1, den - 1)
    steps = [f"Dividing ${num}$ by ${den}$ gives a terminating decimal, since ${den}$ has no prime "
             "factors other than $2$ and $5$.",
             f"\\[ \\frac{{{num}}}{{{den}}} = \\frac{{{num} \\cdot {10000 // den}}}{{10000}} = "
             f"{num / den:g}. \\]"]
    truth = f"\\frac{{{num}}}{{{den}}}"
    boxed = f"{num / den:g}" if correct else f"{(num + 1) / den:g}"
    return steps, truth, boxed


_KINDS = (_fraction, _root, _square, _decimal)


def _filler(rng: random.Random) -> str:
    """A paragraph of side computations, as reasoning models write while they check their work."""
    p, q, r = rng.randint(2, 30), rng.randint(2, 30), rng.randint(2, 9)
    return (f"Before going on, let me double-check the arithmetic. We have ${p} \\times {q} = {p * q}$ and "
            f"${p} + {q} = {p + q}$, so $\\frac{{{p * q}}}{{{p + q}}} \\approx {p * q / (p + q):.3f}$. "
            f"Also ${r}^3 = {r ** 3}$ and $\\sqrt{{{r * r}}} = {r}$; none of these change the result, "
            f"but it is easy to slip here, so each line is worth verifying: "
            f"\\[ {p}^2 - {q}^2 = ({p} - {q})({p} + {q}) = {p * p - q * q}. \\]")


def solutions(count: int, seed: int = 0, paragraphs: int = 12) -> List[Solution]:
    """`count` solutions, alternately right and wrong, of ~paragraphs x 300 characters each."""
    rng = random.Random(seed)
    out = []
    for i in range(count):
        correct = i % 2 == 0
        steps, truth, boxed = _KINDS[i % len(_KINDS)](rng, correct)
        body = [_filler(rng) for _ in range(paragraphs)]
        body[1:1] = steps  # the real steps early, the checks around them
        text = "\n\n".join(["Let's solve this step by step.", *body,
                            f"Therefore, the final answer is $\\boxed{{{boxed}}}$."])
        out.append(Solution(text, truth, correct))
    return out
