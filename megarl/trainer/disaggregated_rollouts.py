"""The trainer ranks' RolloutSource when the engines run on rollout ranks of their own.

A step reads its finished samples from the channel (generated meanwhile, with weights at most
async.max_staleness steps old: rollout_ranks/server.py) and scores them; a weight push is announced on
the channel, then streamed over the trainer-rollout bridge by the same sync as the colocated
engines' (megarl.resharding; the trainer ranks are its sources and hold no destination).
Every sample is checked against the staleness bound and every step's prompts against this rank's
own sampler, so the data position saved in checkpoints is the one the rollouts really used.
Held-out evaluations are requested on the channel and run on the rollout ranks between weight
pushes (rollout_ranks/evaluation.py); evaluate() returns at once, except after the last step, and the
metrics of those finished meanwhile come back from evaluations(), each with the version it
evaluated. When an engine is replaced (rollout_ranks/supervisor.py), the trainers join the new
generation's bridge, publish where it starts and push their current weights to it; a push that
fails because its engine died is pushed again to the replacement (an evaluation it was running is
run by the replacement). Trainer rank 0 decides each of these turns and tells the others, so all
trainer ranks take them together.
Does not own generation (rollout_ranks/server.py) or the loss for stale samples (the actor's
rollout_correction, fed each token's own behaviour log-prob).
"""

import time
from dataclasses import replace
from typing import Callable, Dict, List, Sequence, Tuple

import torch
import torch.distributed as dist

from megarl.algos.staleness import sequence_lags
from megarl.models.hf.config import ModelArch
from megarl.parallel_state.roles import Role
from megarl.planning.resolved import ResolvedRun
from megarl.resharding.adapter_sync import push_weights
from megarl.rewards.scorer import Scorer
from megarl.rollout.builder import load_training_prompts
from megarl.rollout.collect import scored
from megarl.rollout.engine import WeightLayout, WeightUpdateReport
from megarl.rollout.prompts import Prompt, PromptSampler
from megarl.rollout_ranks.channel import RolloutChannel, Start
from megarl.trainer.rollout_source import Rollouts, step_rollouts


class RemoteEngine:
    """The weight destination as a trainer rank sees it: the engine's layout, on ranks it does
    not hold (the sync sends from here; the rollout ranks check completeness)."""

    def __init__(self, layout: WeightLayout):
        self.layout = layout

    def weight_layout(self) -> WeightLayout:
        return self.layout

    def begin_weight_update(self, expected: Dict[str, Tuple[int, ...]]) -> None:
        if expected:
            raise RuntimeError(f"the sync plan puts {len(expected)} engine tensors on a trainer rank")

    def open_tensors(self, names: Sequence[str]) -> Dict[str, torch.Tensor]:
        return {}

    def close_tensors(self, names: Sequence[str]) -> None:
        pass

    def finish_weight_update(self) -> WeightUpdateReport:
        return WeightUpdateReport(params_expected=0, params_loaded=0)

    def needs_base_weights(self) -> bool:
        return False  # the rollout ranks say whether theirs do

    def load_adapters(self, tensors: Dict[str, torch.Tensor]) -> None:
        raise RuntimeError("the adapter sync loads adapters into a trainer rank")


class DisaggregatedStart:
    """A trainer rank beside rollout ranks of their own, before its models: no engine, the
    tokenizer and the training prompts the rollout ranks' draws index (held-out sets are theirs)."""

    def __init__(self, run: ResolvedRun, role: Role):
        import transformers  # slow to import: only where a run starts

        self.run, self.role = run, role
        self.tokenizer = transformers.AutoTokenizer.from_pretrained(run.config.model.hf_dir)
        self.prompts = load_training_prompts(run.config.data, self.tokenizer)
        self.held_out_sizes: Dict[str, int] = {}  # the rollout ranks load and score them

    def source(self, sampler: PromptSampler, scorer: Scorer, scorer_of,
               actor, others) -> "DisaggregatedRollouts":
        """The source; `scorer_of`, `actor` and `others` are the colocated start's (held-out sets
        and the memory handoff), which the rollout ranks do without."""
        return DisaggregatedRollouts(self.run, self.role, self.tokenizer, self.prompts.prompts, sampler,
                                     scorer)


class DisaggregatedRollouts:
    def __init__(self, run: ResolvedRun, role: Role, tokenizer, prompts: List[Prompt],
                 sampler: PromptSampler, scorer: Scorer):
        self.config, self.role, self.tokenizer = run.config, role, tokenizer
        self.adapters = run.adapters is not None
        self.prompts, self.sampler, self.scorer = prompts, sampler, scorer
        self.channel = RolloutChannel(role.store)
        self.engine = None  # a RemoteEngine, once the first push knows the model (its LoRA slots)
        self.sent_bytes = 0  # what this rank sent in the last push (a LoRA actor's: its adapters)
        self.version = None  # of the weights last pushed
        self.weights = None  # (chunks, arch) of the actor: pushed again to a replaced engine
        self.requested = 0  # held-out evaluations requested so far
        self.unanswered: List[int] = []  # of them, those whose metrics have not come back (rank 0)

    def _agree(self, choice):
        """Trainer rank 0's `choice`, on every trainer rank."""
        box = [choice]
        if self.role.size > 1:
            dist.broadcast_object_list(box, src=0)
        return box[0]

    def _replaced(self) -> bool:
        return self._agree(self.role.rank == 0 and self.channel.generation() > self.role.generation)

    def _follow_generation(self) -> None:
        """Join the engines' newest generation and tell it where to start."""
        generation = self._agree(self.channel.generation() if self.role.rank == 0 else None)
        if self.role.rank == 0:
            self.channel.start(generation, Start(self.version, self.sampler.state_dict()))
        self.role.join_bridge(generation)

    def push_weights(self, chunks: List[torch.nn.Module], arch: ModelArch, version: int) -> None:
        first = self.version is None
        if first:
            layout = self.config.layout
            self.engine = RemoteEngine(WeightLayout(
                "vllm", layout.rollout_world_size, layout.rollout_tp, layout.rollout_ep,
                first_rank=self.role.first_rollout_rank,
                adapters=self.adapters, quantization=self.config.rollout.quantization,
                router_fp32=self.config.model.router_fp32))
        self.version, self.weights = version, (chunks, arch)
        if first and self.role.rank == 0:  # where the rollout side starts drawing
            self.channel.start(self.role.generation, Start(version, self.sampler.state_dict()))
        self._push()

    def _push(self) -> None:
        """Push until an engine generation has the weights (a dead engine's replacement gets them)."""
        while True:
            if self._replaced():
                self._follow_generation()
            if self.role.rank == 0:
                self.channel.announce_weights(self.role.generation, self.version)
            chunks, arch = self.weights
            failure = None
            try:
                report = push_weights(chunks, arch, self.engine, self.config.layout.sync_bucket_mb * 2**20,
                                      links=self.role.bridge)
                self.sent_bytes = report.pushed_bytes
            except RuntimeError as error:  # an engine died: "Connection closed by peer", or the bridge's
                # wait ran past collective_timeout_s (NCCL, or a peer that never answers: links.py)
                failure = error
            status = torch.tensor([failure is None], dtype=torch.int32, device=self.role.bridge.device)
            dist.all_reduce(status, op=dist.ReduceOp.MIN)
            if int(status):
                return
            self._await_replacement(failure)

    def _await_replacement(self, failure) -> None:
        """A push failed: wait for the engines' next generation; a failure no replacement
        follows within the collective timeout is not an engine's death, and is raised."""
        deadline = time.monotonic() + self.config.collective_timeout_s
        while True:
            turn = self._agree(None if self.role.rank else (
                "replaced" if self.channel.generation() > self.role.generation
                else "late" if time.monotonic() > deadline else "wait"))
            if turn == "replaced":
                return
            if turn == "late":
                raise RuntimeError(f"a weight push failed and no rollout engine was replaced within "
                                   f"collective_timeout_s={self.config.collective_timeout_s}: {failure}")
            time.sleep(0.01)

    def _wait_until(self, ready: Callable[[], bool]) -> None:
        """Until `ready()` (asked on rank 0), following engine replacements meanwhile."""
        while True:
            turn = self._agree(None if self.role.rank else (
                "replaced" if self.channel.generation() > self.role.generation
                else "ready" if ready() else "wait"))
            if turn == "ready":
                return
            if turn == "replaced":
                self._follow_generation()
                self._push()
            else:
                time.sleep(0.005)

    def rollouts(self, number: int) -> Rollouts:
        self._wait_until(lambda: self.channel.has_rollouts(number))
        sent = self.channel.take_rollouts(number)
        if self.role.rank == 0 and number > 1:
            self.channel.forget_rollouts(number - 1)  # every rank read it before the last step's sync
        parts, prompts = [], []
        for indices, samples in zip(sent.rounds, sent.samples):  # with dynamic sampling, each round
            drawn = self.sampler.next_batch()
            if indices != drawn:
                raise RuntimeError(f"step {number}: the rollout ranks drew prompts {indices[:8]}..., this "
                                   f"trainer's sampler {drawn[:8]}...: the two sides' data positions differ "
                                   "(a bug: both follow the start the trainer published)")
            round_prompts = [self.prompts[i] for i in drawn]
            parts.append(scored(samples, round_prompts, self.tokenizer, self.scorer))
            prompts += round_prompts
        rollouts = step_rollouts(parts, prompts, self.config)
        batch = rollouts.collected.batch
        lags = sequence_lags(batch.rollout_versions, batch.loss_mask, self.version)
        bound = self.config.async_.max_staleness
        if int(lags.max()) > bound:
            raise RuntimeError(f"step {number}: a sample is {int(lags.max())} versions older than the "
                               f"trainer's {self.version}, beyond async.max_staleness={bound}")
        return replace(rollouts, metrics={
            **rollouts.metrics, **sent.metrics, "async/sample_lag_mean": float(lags.double().mean()),
            "async/sample_lag_max": int(lags.max()), "async/engine_restarts": self.role.generation,
            "sync/bytes_sent": self.sent_bytes})

    def evaluate(self, version: int) -> Dict[str, float]:
        """Request the evaluation of the weights after step `version` (the last pushed) and return
        {} at once: the rollout ranks run it while this rank trains, and its metrics come back from
        evaluations(). After the last step, wait for it (its weights are the run's result; no
        push follows, so it runs whole) and return its metrics. Collective."""
        number, last = self.requested, version == self.config.steps
        self.requested += 1
        if self.role.rank == 0:
            self.channel.request_evaluation(number, version)
            if not last:
                self.unanswered.append(number)
        if not last:
            return {}
        self._wait_until(lambda: self.channel.has_evaluation(number))
        return self._agree(self.channel.evaluation(number).metrics if self.role.rank == 0 else None)

    def evaluations(self) -> List[Tuple[int, Dict[str, float]]]:
        """(version evaluated, metrics) of the evaluations finished since the last call, oldest
        first. A request made while an earlier one's evaluation ran is answered by that
        evaluation, restarted with the newer weights: the earlier one gets no answer of its own.
        Collective."""
        found = []
        if self.role.rank == 0:
            for number in self.unanswered:
                if self.channel.has_evaluation(number):
                    evaluation = self.channel.evaluation(number)
                    found.append((evaluation.version, evaluation.metrics))
                    self.unanswered = [n for n in self.unanswered if n > number]
        return self._agree(found)

    def shutdown(self) -> None:
        if self.role.rank == 0:
            self.channel.stop()
        self.scorer.close()
