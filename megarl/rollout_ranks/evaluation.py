"""Held-out evaluations on rollout ranks of their own (layout.rollout_world_size > 0): the engines
evaluate the weights they hold between weight pushes, while the trainer ranks train.

Trainer rank 0 requests an evaluation right after pushing the weights to evaluate (loop.py asks
when eval.* says one is due; disaggregated_rollouts.py); the rollout leader (the rollout world's
rank 0) reads the request on the channel and every rank of the rollout world takes it in the same
turn (rollout_ranks/server.py). Each set is a streamed draw of its own of the run's producer
(megarl/rollout/producer.py), split over the engines as training's draws are
(shares.SharedDraws), started after the training draws the same weights allow, so each engine
batches its requests with training's and the trainer waits for neither; a weight push never waits
for an evaluation. A push that comes while one runs drops its draws and the evaluation starts
again, whole, with the new weights (async/eval_restarts), so its numbers are always those of one
version, the one its result names: an evaluation longer than a training step is thus put off until
the pushes pause (after the last step they stop).

A set is sampled as the colocated and the standalone evaluation sample it (evaluator.set_sampling;
a streamed draw samples what engine.generate does). The rollout leader scores it, in a thread of
its own while the engines go on, with Scorers of its own built from the same reward tables (a
pool of algo.reward_workers each), so held-out scoring takes no trainer time and stops no
generation, however slow the reward. Reward models run on the trainer ranks: a set scored by one
is refused with rollout ranks of their own (config.py).

Owns the rollout side's evaluation in flight. Does not own when one is due (loop.py, EvalConfig),
the metrics (megarl/evaluation) or the engines' loop (rollout_ranks/server.py).
"""

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

from megarl.evaluation.eval_metrics import aggregate
from megarl.evaluation.evaluator import scored_rows, set_sampling
from megarl.evaluation.sets import HeldOut, load_sets
from megarl.planning.resolved import ResolvedRun
from megarl.rewards.scorer import Scorer
from megarl.rollout.engine import RolloutSample
from megarl.rollout.shares import SharedDraws
from megarl.rollout_ranks.channel import Evaluation, RolloutChannel


def _draw(name: str) -> str:
    """Set `name`'s streamed draw (training's draws are step numbers)."""
    return f"eval/{name}"


@dataclass
class _Pending:
    request: int  # the newest request it answers
    wanted: int  # that request's version: the weights are at least as new when it starts
    version: Optional[int] = None  # of the weights sampling it; None: not (re)started yet
    started: float = 0.0
    restarts: int = 0
    samples: Dict[str, List[RolloutSample]] = field(default_factory=dict)  # its sets sampled so far


class RolloutEvaluations:
    """Every rank of the rollout world holds one; `leader`: its rank 0's, which reads requests,
    scores and delivers."""

    def __init__(self, run: ResolvedRun, tokenizer, channel: RolloutChannel, draws: SharedDraws,
                 leader: bool):
        config = run.config
        data, algo = config.data, config.algo
        self.config, self.leader = run.eval, leader
        if leader:
            def scorer_of(table):
                return Scorer(table, algo.reward_workers, algo.reward_timeout_s, collective=False)

            self.training = scorer_of(algo.reward_table)
            self.held_out = HeldOut.load(self.config, tokenizer, data.max_prompt_len, data.overlong_prompts,
                                         self.training, scorer_of)
            self.prompts = self.held_out.prompts
            self.scoring = ThreadPoolExecutor(1)
        else:
            self.prompts = load_sets(self.config, tokenizer, data.max_prompt_len, data.overlong_prompts)
        self.seed, self.tokenizer, self.channel = config.seed, tokenizer, channel
        self.draws = draws
        self.seen = 0  # requests the leader has read
        self.pending: Optional[_Pending] = None  # taken, being sampled
        self.scored: List[Tuple[int, Future]] = []  # the leader's: (request, its Evaluation), oldest first

    def new_request(self) -> Optional[Tuple[int, int]]:
        """The leader's: (number, version) of the newest request, when it is new and no earlier
        generation of engines answered it (earlier ones unanswered are answered by it)."""
        count = self.channel.evaluation_requests()
        if count <= self.seen:
            return None
        self.seen, newest = count, count - 1
        if self.channel.has_evaluation(newest):
            return None
        return newest, self.channel.evaluation_version(newest)

    def news(self) -> bool:
        """The leader's, waiting: a request not read yet, or a scored evaluation to deliver."""
        scored = bool(self.scored) and self.scored[0][1].done()
        return scored or self.channel.evaluation_requests() > self.seen

    def request(self, number: int, wanted: int) -> None:
        """Take request `number` (of the weights after step `wanted`): the evaluation being
        sampled, whose weights are as new, answers it too."""
        if self.pending is None:
            self.pending = _Pending(number, wanted)
        else:
            self.pending.request, self.pending.wanted = number, wanted

    def startable(self, version: int) -> bool:
        pending = self.pending
        return pending is not None and pending.version is None and version >= pending.wanted

    def start(self, version: int) -> None:
        """Submit the evaluation taken (or dropped at a push) with the weights of `version`."""
        if not self.startable(version):
            return
        for name, prompts in self.prompts.items():
            sampling = set_sampling(self.config, name, self.seed, self.tokenizer.eos_token_id)
            self.draws.start(_draw(name), prompts, sampling)
        self.pending.version, self.pending.started = version, time.perf_counter()

    def drop(self) -> None:
        """Before a weight update: the evaluation being sampled is dropped, to start again, whole,
        with the new weights."""
        pending = self.pending
        if pending is None or pending.version is None:
            return
        for name in self.prompts:
            if name not in pending.samples:
                self.draws.drop(_draw(name))
        pending.version, pending.samples = None, {}
        pending.restarts += 1

    def sampled(self) -> None:
        """Once every set of the evaluation being sampled is: the leader scores it meanwhile.
        Every rank of the rollout world, in the same turn (collective: SharedDraws.finished)."""
        pending = self.pending
        if pending is None or pending.version is None:
            return
        for name in self.prompts:
            samples = None if name in pending.samples else self.draws.finished(_draw(name))
            if samples is not None:
                pending.samples[name] = samples
        if len(pending.samples) == len(self.prompts):
            if self.leader:
                self.scored.append((pending.request, self.scoring.submit(self._score, pending)))
            self.pending = None

    def _score(self, pending: _Pending) -> Evaluation:
        held_out = self.held_out
        rows = [row for name, prompts in held_out.prompts.items() for row in
                scored_rows(name, prompts, pending.samples[name], self.tokenizer, held_out.scorers[name])]
        return Evaluation(pending.version, {
            **aggregate(rows, self.config.pass_k, self.config.threshold),
            "async/eval_s": time.perf_counter() - pending.started, "async/eval_restarts": pending.restarts})

    def deliver(self) -> None:
        """The leader's: put the evaluations scored so far on the channel, in order."""
        while self.scored and self.scored[0][1].done():
            request, scored = self.scored.pop(0)
            self.channel.put_evaluation(request, scored.result())

    def close(self) -> None:
        if self.leader:
            self.scoring.shutdown(cancel_futures=True)  # those unanswered are no longer wanted
            self.held_out.close(self.training)
            self.training.close()
