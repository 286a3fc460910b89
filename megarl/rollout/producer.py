"""How samples are produced from a rollout engine: the seam where multi-turn agent loops plug in.

Owns the SampleProducer protocol, the built-in producer (one completion per sample) and resolving
`generation.producer` to one. A producer gets this engine's share of the prompts and returns the
samples of all of them (`sampling.n` each, `prompt_index` into the prompts it was given); a
producer that edits a sample's tokens keeps its `routed_experts` (when the engine returned them)
one row per token fed through the engine; one that inserts tokens the engine did not generate
marks them 0 in `response_mask`. A producer that holds processes (the agent loop's tool workers)
has a `close()`, called when the run ends. Does not own splitting prompts over engines or
gathering samples (collect.py).
"""

from typing import Callable, Dict, List, Protocol, Sequence

from megarl.plugins.loading import load_callable
from megarl.rollout.agent_loop import AgentConfig, AgentLoop
from megarl.rollout.engine import RolloutEngine, RolloutSample, SamplingConfig
from megarl.rollout.prompts import Prompt


class SampleProducer(Protocol):
    def produce(self, engine: RolloutEngine, prompts: Sequence[Prompt],
                sampling: SamplingConfig) -> List[RolloutSample]:
        ...


class Completion:
    """One completion per sample: the engine's own generate."""

    def produce(self, engine: RolloutEngine, prompts: Sequence[Prompt],
                sampling: SamplingConfig) -> List[RolloutSample]:
        return engine.generate([p.token_ids for p in prompts], sampling)


def load_producer(name: str, tokenizer, agent: AgentConfig) -> SampleProducer:
    """`completion`, `agent` (multi-turn with tools: agent_loop.py, configured by `agent`), or
    'module:function' returning a producer (called once, at setup, with no arguments)."""
    builtin: Dict[str, Callable[[], SampleProducer]] = {
        "completion": Completion, "agent": lambda: AgentLoop(tokenizer, agent)}
    return load_callable(name, builtin, "generation.producer")()
