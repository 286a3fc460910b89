"""How samples are produced from a rollout engine: the seam where multi-turn agent loops plug in.

Owns the SampleProducer protocol, the built-in producer (one completion per sample) and resolving
`generation.producer` to one. A producer gets this engine's share of the prompts and returns the
samples of all of them (`sampling.n` each, `prompt_index` into the prompts it was given); a
producer that edits a sample's tokens keeps its `routed_experts` (when the engine returned them)
one row per token fed through the engine. Does not own splitting prompts over engines or
gathering samples (collect.py).
"""

from typing import Callable, Dict, List, Protocol, Sequence

from megarl.plugins.loading import load_callable
from megarl.rollout.engine import RolloutEngine, RolloutSample, SamplingConfig


class SampleProducer(Protocol):
    def produce(self, engine: RolloutEngine, prompts: Sequence[List[int]],
                sampling: SamplingConfig) -> List[RolloutSample]:
        ...


class Completion:
    """One completion per sample: the engine's own generate."""

    def produce(self, engine: RolloutEngine, prompts: Sequence[List[int]],
                sampling: SamplingConfig) -> List[RolloutSample]:
        return engine.generate(prompts, sampling)


PRODUCERS: Dict[str, Callable[[], SampleProducer]] = {"completion": Completion}


def load_producer(name: str) -> SampleProducer:
    """A built-in producer, or 'module:function' returning one (called once, at setup)."""
    return load_callable(name, PRODUCERS, "generation.producer")()
