"""Where a step's rollouts come from: the seam where disaggregated, asynchronous rollout plugs in
(disaggregated_rollouts.py).

Owns the RolloutSource protocol (a step's scored rollouts; an evaluation of the held-out sets;
the actor's new weights after its update), the sampling of each step (the same whichever source
generates it), and the colocated implementation, ColocatedRollouts: the training ranks themselves
generate, synchronously, inside the hybrid-engine memory handoff (megarl/actor/offload.py:
training state off, the engine's weights in, the weights last pushed synced, the KV cache in,
generation, and back), with DAPO dynamic sampling's extra rounds; evaluations go through the same
handoff. Does not own generation (the engine and its sample producer), scoring (collect.py), the
evaluation's metrics (megarl/evaluation) or what the step does with the rollouts (loop.py).
"""

import contextlib
import time
from dataclasses import dataclass, field, replace
from typing import Dict, Iterator, List, NamedTuple, Optional, Protocol, Sequence, Tuple

import torch

from megarl.actor.offload import device_to_engine
from megarl.actor.optimizer import TrainState
from megarl.algos.shaping import informative_groups
from megarl.evaluation.evaluator import evaluate
from megarl.evaluation.sets import HeldOut
from megarl.models.hf.config import ModelArch
from megarl.planning.config import RunConfig
from megarl.planning.resolved import ResolvedRun
from megarl.resharding.adapter_sync import push_weights
from megarl.rewards.scorer import Scorer
from megarl.rollout.builder import build_rollout_side
from megarl.rollout.collect import Collected, collect, keep_informative
from megarl.rollout.engine import StreamingEngine
from megarl.rollout.producer import SampleProducer
from megarl.rollout.prompts import Prompt, PromptSampler
from megarl.rollout.turns import TurnDriver
from megarl.rollout_ranks.dynamic_sampling import informative_count, rounds_wanted, step_sampling


@dataclass(frozen=True)
class Rollouts:
    collected: Collected  # scored rollouts, the same on every rank
    prompts: List[Prompt]  # what the batch's group ids index
    generated_lengths: List[int]  # every sequence generated this step, kept or not (FLOPs)
    metrics: dict = field(default_factory=dict)  # the source's own (dynamic sampling, memory)
    # Seconds of the weight sync that ran inside rollouts() (colocated: the sync is part of the
    # memory handoff), which the loop books under "sync", not "generate"; 0 where push_weights syncs.
    sync_seconds: float = 0.0


class RolloutSource(Protocol):
    def rollouts(self, number: int) -> Rollouts:
        """Step `number`'s scored rollouts. Collective."""

    def evaluate(self, version: int) -> Dict[str, float]:
        """The held-out sets' metrics (megarl/evaluation) with the weights after step `version`
        (0: the initial ones), the last pushed; {} where the evaluation runs meanwhile (rollout
        ranks of their own: its metrics come back from evaluations()). Collective."""

    def evaluations(self) -> List[Tuple[int, Dict[str, float]]]:
        """(version evaluated, metrics) of the evaluations finished meanwhile since the last call.
        Collective."""

    def push_weights(self, chunks: List[torch.nn.Module], arch: ModelArch, version: int) -> None:
        """Make the actor's weights (its Megatron chunks) after step `version` (0: the initial
        ones) the ones rollouts use next. Collective."""

    def shutdown(self) -> None:
        ...


def step_rollouts(parts: List[Collected], prompts: List[Prompt], config: RunConfig) -> Rollouts:
    """A step's Rollouts from its rounds (scored, in draw order; `prompts`: theirs, in order):
    the one round as it is, or with dynamic sampling the first prompts_per_step groups whose
    rewards differ (keep_informative), with the rounds' metrics."""
    if not config.algo.dynamic_sampling_rounds:
        return Rollouts(parts[0], prompts, parts[0].batch.lengths.tolist())
    kept = keep_informative(parts, config.data.prompts_per_step)
    batch = kept.batch
    informative = torch.unique(batch.group_ids[informative_groups(batch.rewards, batch.group_ids)])
    generated = [n for part in parts for n in part.batch.lengths.tolist()]
    return Rollouts(kept, prompts, generated, {
        "dynamic_sampling/rounds": len(parts),
        "dynamic_sampling/informative_groups": sum(map(informative_count, parts)),
        "dynamic_sampling/uninformative_kept": len(torch.unique(batch.group_ids)) - len(informative)})


class _Pushed(NamedTuple):
    """The weights last pushed: what the next step syncs into the engine before it generates."""
    chunks: List[torch.nn.Module]
    arch: ModelArch
    version: int


class ColocatedStart:
    """A colocated rank's rollout side, made before its models (on a GPU vLLM starts only with
    gpu_memory_utilization x the device free), its engine asleep until the first step's sync."""

    def __init__(self, run: ResolvedRun):
        self.run = run
        self.side = build_rollout_side(run.engine, run.config.data, run.config.generation)
        self.side.engine.release_memory()
        self.tokenizer, self.prompts = self.side.tokenizer, self.side.prompts
        self.held_out_sizes: Dict[str, int] = {}

    def source(self, sampler: PromptSampler, scorer: Scorer, scorer_of, actor: TrainState,
               others: Sequence[TrainState]) -> "ColocatedRollouts":
        data, side = self.run.config.data, self.side
        held_out = HeldOut.load(self.run.eval, self.tokenizer, data.max_prompt_len, data.overlong_prompts,
                                scorer, scorer_of)
        self.held_out_sizes = {name: len(prompts) for name, prompts in held_out.prompts.items()}
        return ColocatedRollouts(self.run.config, side.engine, side.producer, self.tokenizer,
                                 self.prompts.prompts, sampler, scorer, actor, others, held_out)


class ColocatedRollouts:
    """Every training rank also runs (a rank of) a rollout engine; one step syncs and generates,
    then trains. The engine keeps nothing while it sleeps (VLLMEngine.release_memory), so each
    step syncs the weights last pushed before it generates."""

    def __init__(self, config: RunConfig, engine: StreamingEngine, producer: SampleProducer, tokenizer,
                 prompts: List[Prompt], sampler: PromptSampler, scorer: Scorer,
                 actor: TrainState, others: Sequence[TrainState], held_out: HeldOut):
        """`actor`: the training state whose weights are pushed (its parameters are the sync's
        source); `others` (the critic's): moved off the device too while the engine runs."""
        self.config, self.engine, self.producer, self.tokenizer = config, engine, producer, tokenizer
        self.driver = TurnDriver(engine)  # one version a draw: no versions stamped
        self.prompts, self.sampler, self.scorer = prompts, sampler, scorer
        self.actor, self.others = actor, list(others)
        self.held_out = held_out
        self._pushed: Optional[_Pushed] = None

    @contextlib.contextmanager
    def _engine_with(self, version: int, purpose: str) -> Iterator[dict]:
        """The memory handoff with the weights after step `version` synced into the awake engine;
        yields a dict that holds, once the block ends, the handoff's bytes offloaded and the
        sync's seconds."""
        pushed = self._pushed
        if pushed is None or pushed.version != version:
            have = "none were" if pushed is None else f"those after step {pushed.version} were"
            raise RuntimeError(f"{purpose} uses the weights after step {version}, but {have} pushed: "
                               f"call push_weights(..., version={version}) first")
        handoff = {}

        def sync():
            start = time.perf_counter()
            report = push_weights(pushed.chunks, pushed.arch, self.engine,
                                  bucket_bytes=self.config.layout.sync_bucket_mb * 2**20)
            handoff["sync_seconds"] = time.perf_counter() - start
            handoff["sync_bytes"] = report.engine_bytes

        with device_to_engine(self.actor, self.others, self.engine, sync,
                              self.config.offload_params) as offloaded:
            handoff["offloaded"] = offloaded
            yield handoff

    def rollouts(self, number: int) -> Rollouts:
        """With DAPO dynamic sampling, groups whose rewards are all equal are dropped and more
        prompts are drawn, up to algo.dynamic_sampling_rounds extra rounds."""
        with self._engine_with(number - 1, f"step {number}") as handoff:
            rollouts = self._rounds(number)
        # sync/engine_bytes: what this rank's engine took in (with LoRA, the adapters alone after
        # the first sync)
        return replace(rollouts, metrics={**rollouts.metrics, "memory/offloaded_bytes": handoff["offloaded"],
                                          "sync/engine_bytes": handoff["sync_bytes"]},
                       sync_seconds=handoff["sync_seconds"])

    def evaluate(self, version: int) -> Dict[str, float]:
        held_out = self.held_out
        with self._engine_with(version, "the evaluation"):
            return evaluate(self.driver, self.producer, held_out.prompts, held_out.config, self.tokenizer,
                            held_out.scorers, self.config.seed)

    def evaluations(self) -> List[Tuple[int, Dict[str, float]]]:
        return []  # evaluate() returns each

    def _rounds(self, number: int) -> Rollouts:
        """With DAPO dynamic sampling, rounds of prompts_per_step prompts until enough groups are
        informative (rounds_wanted)."""
        algo, parts, prompts = self.config.algo, [], []
        while True:
            batch_prompts = [self.prompts[i] for i in self.sampler.next_batch()]
            sampling = step_sampling(self.config, self.tokenizer, number, len(parts))
            parts.append(collect(self.driver, self.producer, batch_prompts, sampling, self.tokenizer,
                                 self.scorer))
            prompts += batch_prompts
            if not rounds_wanted(parts, algo.dynamic_sampling_rounds, self.config.data.prompts_per_step):
                return step_rollouts(parts, prompts, self.config)

    def push_weights(self, chunks: List[torch.nn.Module], arch: ModelArch, version: int) -> None:
        """Recorded only: the next rollouts() syncs them once the training state has left the
        device (a giant model's engine cannot wake beside its optimizer state)."""
        self._pushed = _Pushed(chunks, arch, version)

    def shutdown(self) -> None:
        self.engine.shutdown()
        self.held_out.close(self.scorer)
        self.scorer.close()
        self.producer.close()
