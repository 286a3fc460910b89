"""How samples are produced from a rollout engine: the seam where completions, multi-turn agent
loops and users' producers plug in, the same for colocated engines and rollout ranks of their own.

A SampleProducer works in draws: `start` a draw (its prompts, `sampling.n` samples each), `step`
it along (one engine step through the TurnDriver, and whatever else the producer waits on: tool
calls), and take its samples from `finished` once all are done (prompt order, then sample order;
`prompt_index` into the draw's prompts). Several draws may be in flight at once (the rollout
ranks stream the next steps' and a held-out evaluation's), and weight updates may come between
steps (the driver interrupts and resumes the turns in flight: turns.py). Colocated engines, the
held-out evaluator and the standalone evaluator drive one draw to its end (`produce`).
A producer that edits a sample's tokens keeps its `routed_experts` (when the engine returned them)
one row per token fed through the engine; one that inserts tokens the engine did not generate
marks them 0 in `response_mask`. A producer that holds processes (the agent loop's tool workers)
releases them in `close()`, called when the run ends.

The built-ins: `completion` (completion.py: one turn per sample) and `agent` (rollout/agent/loop.py).
A user's `module:function` is called once, with no arguments, and returns either a producer of
this interface or, the shortcut, an object with `produce(engine, prompts, sampling)` returning the
samples of a whole draw at once (WholeDraws runs it inside one step, so no weight update lands in
the middle of it).

Owns the protocol, driving one draw to its end, the shortcut's adapter and resolving
`generation.producer`. Does not own splitting prompts over engines or gathering samples
(collect.py).
"""

from typing import Callable, Dict, List, Optional, Protocol, Sequence

import torch

from megarl.plugins.loading import load_callable
from megarl.rollout.agent.loop import AgentConfig, AgentLoop
from megarl.rollout.completion import Completion
from megarl.rollout.draws import Draw
from megarl.rollout.engine import RolloutSample, SamplingConfig
from megarl.rollout.prompts import Prompt
from megarl.rollout.turns import TurnDriver


class SampleProducer(Protocol):
    def start(self, driver: TurnDriver, draw: Draw, prompts: Sequence[Prompt],
              sampling: SamplingConfig) -> None:
        """Begin draw `draw`: `sampling.n` samples of each prompt, sample j of prompt i seeded by
        engine.sample_seed(sampling, i, j)."""

    def step(self, driver: TurnDriver) -> None:
        """Move the draws in flight along: one engine step, and what else they wait on."""

    def finished(self, driver: TurnDriver, draw: Draw) -> Optional[List[RolloutSample]]:
        """Draw `draw`'s samples once every one is finished (then forgotten), else None; with each
        response token's policy version where the driver tracks versions."""

    def drop(self, driver: TurnDriver, draw: Draw) -> None:
        """Forget draw `draw`, aborting what it has in flight."""

    def busy(self) -> bool:
        """A draw in flight has an unfinished sample (stepping moves it on)."""

    def draws_in_flight(self) -> int:
        """Draws started and not yet taken from `finished` or dropped."""

    def close(self) -> None:
        ...


_ONE = "produce"  # the draw produce() drives


def produce(producer: SampleProducer, driver: TurnDriver, prompts: Sequence[Prompt],
            sampling: SamplingConfig) -> List[RolloutSample]:
    """One draw, driven to its end with the weights the engine holds."""
    producer.start(driver, _ONE, prompts, sampling)
    while True:
        samples = producer.finished(driver, _ONE)
        if samples is not None:
            return samples
        producer.step(driver)


class WholeDraws:
    """The shortcut's adapter: a whole draw of `simple.produce(engine, prompts, sampling)` inside
    one step, every token stamped with the driver's version."""

    def __init__(self, simple):
        self.simple = simple
        self._waiting: Dict[Draw, tuple] = {}  # started, not produced yet
        self._done: Dict[Draw, List[RolloutSample]] = {}

    def start(self, driver: TurnDriver, draw: Draw, prompts: Sequence[Prompt],
              sampling: SamplingConfig) -> None:
        self._waiting[draw] = (list(prompts), sampling)

    def step(self, driver: TurnDriver) -> None:
        waiting, self._waiting = self._waiting, {}
        for draw, (prompts, sampling) in waiting.items():
            samples = self.simple.produce(driver.engine, prompts, sampling)
            if driver.tracks_versions:
                for sample in samples:
                    sample.versions = torch.full((len(sample.response_ids),), driver.version,
                                                 dtype=torch.int64)
            self._done[draw] = samples

    def finished(self, driver: TurnDriver, draw: Draw) -> Optional[List[RolloutSample]]:
        return self._done.pop(draw, None)

    def drop(self, driver: TurnDriver, draw: Draw) -> None:
        self._waiting.pop(draw, None)
        self._done.pop(draw, None)

    def busy(self) -> bool:
        return bool(self._waiting)

    def draws_in_flight(self) -> int:
        return len(self._waiting) + len(self._done)

    def close(self) -> None:
        close = getattr(self.simple, "close", None)
        if close is not None:
            close()


_STREAMING = ("start", "step", "finished", "drop", "busy", "draws_in_flight", "close")


def load_producer(name: str, tokenizer, agent: AgentConfig) -> SampleProducer:
    """`completion`, `agent` (multi-turn with tools: rollout/agent/loop.py, configured by `agent`), or
    'module:function' returning a producer (called once, at setup, with no arguments): one of
    this interface, or one with produce(engine, prompts, sampling) (module docstring)."""
    builtin: Dict[str, Callable[[], SampleProducer]] = {
        "completion": Completion, "agent": lambda: AgentLoop(tokenizer, agent)}
    made = load_callable(name, builtin, "generation.producer")()
    if all(callable(getattr(made, method, None)) for method in _STREAMING):
        return made
    if callable(getattr(made, "produce", None)):
        return WholeDraws(made)
    raise TypeError(f"generation.producer={name!r} returned {type(made).__name__}, which has neither "
                    f"produce(engine, prompts, sampling) nor the streaming methods {list(_STREAMING)}: "
                    "see megarl/rollout/producer.py")
