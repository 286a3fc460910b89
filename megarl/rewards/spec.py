"""A reward as configured: a weighted sum of terms, e.g. `math + 0.5*rm:runs/rm` or
`0.7*my.module:score + 0.3*judge:configs/judge.yaml`.

A term is one of:
- a reward function: a built-in name, 'module:function' or 'path/to/file.py:function', scored per
  sample in the scoring pool (functions.py);
- `rm:PATH`: a discriminative reward model, an HF *ForSequenceClassification checkpoint with one
  label, scored on the training ranks (megarl/critic/reward_model.py);
- `judge:CONFIG`: a generative judge behind an OpenAI-compatible endpoint (judge.py), scored in
  the pool like a function.
Weights are plain numbers (negative ones included: `math + -0.1*rm:PATH`); a term without one
weighs 1. Parsing is pure and names the bad term.
"""

import functools
import re
from dataclasses import dataclass
from typing import Tuple

MODEL_PREFIX = "rm:"
JUDGE_PREFIX = "judge:"
_WEIGHTED = re.compile(r"^\s*([-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)\s*\*\s*(\S.*?)\s*$")


@dataclass(frozen=True)
class Term:
    weight: float
    name: str  # as written: 'math', 'rm:PATH', 'judge:CONFIG', 'module:function'

    @property
    def is_model(self) -> bool:
        return self.name.startswith(MODEL_PREFIX)

    @property
    def model_path(self) -> str:
        return self.name[len(MODEL_PREFIX):]


@dataclass(frozen=True)
class RewardSpec:
    terms: Tuple[Term, ...]

    @property
    def functions(self) -> Tuple[str, ...]:
        """Terms scored in the pool (functions and judges)."""
        return tuple(t.name for t in self.terms if not t.is_model)

    @property
    def models(self) -> Tuple[str, ...]:
        return tuple(t.model_path for t in self.terms if t.is_model)


@functools.lru_cache(maxsize=None)  # a run names a few texts; the scorer asks for one per sample
def parse_spec(text: str, where: str = "algo.reward") -> RewardSpec:
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"{where}={text!r}: name a reward, e.g. 'math' or 'math + 0.5*rm:PATH'")
    terms = []
    for part in text.split(" + ") if " + " in text else [text]:
        match = _WEIGHTED.match(part)
        weight, name = (float(match.group(1)), match.group(2)) if match else (1.0, part.strip())
        if not name or any(c in name for c in " *+"):
            raise ValueError(f"{where}={text!r}: term {part.strip()!r} is not 'NAME' or 'WEIGHT*NAME'; "
                             "separate terms with ' + ' (spaces around the plus)")
        if name.startswith(MODEL_PREFIX) and not name[len(MODEL_PREFIX):]:
            raise ValueError(f"{where}={text!r}: 'rm:' needs the reward model's directory, rm:PATH")
        if name.startswith(JUDGE_PREFIX) and not name[len(JUDGE_PREFIX):]:
            raise ValueError(f"{where}={text!r}: 'judge:' needs the judge's config file, judge:CONFIG")
        terms.append(Term(weight, name))
    names = [t.name for t in terms]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise ValueError(f"{where}={text!r} names {repeated} more than once; give it one weight")
    return RewardSpec(tuple(terms))
