"""A reward function as its author wrote it, called one way whatever its signature; the callables
the scoring pool runs (functions and judges); and the table that gives each data source its reward.

Two signatures, told apart by their parameters:
- megarl's `fn(response, ground_truth) -> float` (a ground truth that is not a string is passed as
  its JSON text);
- verl's `compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs)`,
  called with keywords as verl calls it (extra_info when the function takes it), returning a float
  or a dict whose "score" is the reward and whose other numeric fields (bools as 0/1) are extras
  (logged as reward/<field>_mean; fields that are not numbers, such as text, are not logged).
Either may be `async def` (awaited to completion), and either gets a multi-turn sample's
conversation as `trajectory=` when it has a parameter of that name. A result that is not a finite number is an
error: the scoring pool scores it 0 and counts it.
"""

import asyncio
import inspect
import json
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Mapping, Tuple

from megarl.plugins.loading import load_callable
from megarl.plugins.worker_pool import Loaded
from megarl.rewards.builtin import BUILTIN
from megarl.rewards.judge import Judge
from megarl.rewards.spec import JUDGE_PREFIX, RewardSpec, parse_spec

VERL_PARAMETERS = ("data_source", "solution_str", "ground_truth")


@dataclass(frozen=True)
class Request:
    """What a reward function may see of one sample."""
    response: str  # decoded, special tokens skipped
    ground_truth: Any
    data_source: str = ""
    extra_info: Dict[str, Any] = field(default_factory=dict)
    messages: Tuple[Mapping[str, Any], ...] = ()  # the prompt as chat messages (a text prompt: one user turn)
    # A multi-turn sample's conversation (prompt, assistant turns with their tool calls, tool
    # results, interaction turns with their "reward"); () for a single completion. Passed to a
    # function that has a `trajectory` parameter.
    trajectory: Tuple[Mapping[str, Any], ...] = ()


@dataclass(frozen=True)
class Outcome:
    score: float
    extras: Dict[str, float]


def _outcome(result: Any) -> Outcome:
    extras = {}
    if isinstance(result, Mapping):
        if "score" not in result:
            raise ValueError(f"returned a dict without 'score' (keys {sorted(result)}); verl's "
                             "contract: 'score' is the reward")
        extras = {k: float(v) for k, v in result.items() if k != "score" and isinstance(v, (int, float))}
        result = result["score"]
    if not isinstance(result, (int, float)):
        raise TypeError(f"returned {result!r} ({type(result).__name__}), not a number")
    if not math.isfinite(result):
        raise ValueError(f"reward is {result}")
    return Outcome(float(result), extras)


async def _awaited(awaitable):
    return await awaitable


class RewardFunction:
    """`name` loaded (a built-in, or 'module:function') and called as its signature asks."""

    def __init__(self, name: str):
        self.name = name
        self.fn: Callable = load_callable(name, BUILTIN, "reward")
        parameters = inspect.signature(self.fn).parameters
        self.verl = all(p in parameters for p in VERL_PARAMETERS)
        self.takes_extra_info = "extra_info" in parameters or any(
            p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
        self.takes_trajectory = "trajectory" in parameters
        positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
        required = [p for p in parameters.values() if p.default is inspect.Parameter.empty
                    and p.kind in positional and p.name != "trajectory"]
        if not self.verl and len(required) != 2:
            raise ValueError(f"reward {name!r} takes ({', '.join(parameters)}); write megarl's "
                             "fn(response, ground_truth) or verl's compute_score(data_source, "
                             "solution_str, ground_truth, extra_info=None)")

    def __call__(self, request: Request) -> Outcome:
        if self.verl:
            kwargs = dict(data_source=request.data_source, solution_str=request.response,
                          ground_truth=request.ground_truth)
            if self.takes_extra_info:
                kwargs["extra_info"] = request.extra_info
            if self.takes_trajectory:
                kwargs["trajectory"] = request.trajectory
            result = self.fn(**kwargs)
        else:
            truth = request.ground_truth
            extra = {"trajectory": request.trajectory} if self.takes_trajectory else {}
            truth = truth if isinstance(truth, str) else json.dumps(truth)
            result = self.fn(request.response, truth, **extra)
        if inspect.isawaitable(result):
            result = asyncio.run(_awaited(result))
        return _outcome(result)


def load_reward(name: str) -> Callable[[Request], Outcome]:
    """The pool's callable for a term: a judge (judge:CONFIG) or a reward function."""
    if not name.startswith(JUDGE_PREFIX):
        return RewardFunction(name)
    judge = Judge.from_file(name[len(JUDGE_PREFIX):])
    return lambda r: _outcome(judge(r.response, r.ground_truth, r.data_source, r.messages))


def loaded_functions() -> Loaded:
    """The scoring pool's Caller: reward functions and judges by name, a job's payload its Request."""
    return Loaded(load_reward, lambda function, request: function(request))


@dataclass(frozen=True)
class RewardTable:
    """The reward of each data source (algo.reward_by_source), algo.reward for the rest; each a
    weighted sum of terms (spec.py)."""
    default: str
    by_source: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self):
        parse_spec(self.default)
        for source, text in self.by_source.items():
            parse_spec(text, f"algo.reward_by_source[{source!r}]")

    def spec_for(self, data_source: str) -> RewardSpec:
        return parse_spec(self.by_source.get(data_source, self.default))

    @property
    def specs(self) -> Tuple[RewardSpec, ...]:
        return tuple(parse_spec(text) for text in (self.default, *self.by_source.values()))

    @property
    def names(self) -> List[str]:
        """The functions and judges the scoring pool runs."""
        return sorted({name for spec in self.specs for name in spec.functions})

    @property
    def models(self) -> List[str]:
        """The reward models' directories."""
        return sorted({path for spec in self.specs for path in spec.models})

    def check(self) -> None:
        """Load every function once: a bad name or signature stops the run before any work."""
        for name in self.names:
            load_reward(name)
