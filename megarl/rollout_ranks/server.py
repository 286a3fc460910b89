"""What rollout ranks run in a disaggregated job: vLLM engines (layout.rollout_world_size /
rollout_tp of them) generating the next steps' rollouts while the trainer ranks train, with weights
at most async.max_staleness versions old.

The loop, on every rank of the rollout world in lockstep (its rank 0, the rollout leader, decides
each turn and tells the others, so the ranks of one engine make the same calls on their vLLM
schedulers and every engine joins the same pushes and collectives):
  - a weight push announced -> join it over the bridge; unfinished requests continue (or restart)
    with the new weights (megarl/rollout/turns.py);
  - step n may be drawn once the engine holds version >= n - 1 - max_staleness (its samples are
    then never older than that when step n trains on version n - 1); draw it (step_draws.py; with
    dynamic sampling, once the steps before it have all their rounds); each draw is split over
    the engines, each sampling its share of the prompts (shares.SharedDraws);
  - an evaluation requested (held-out sets) -> its draws go in after the training draws its
    weights allow (rollout_ranks/evaluation.py); a push drops and restarts one in flight;
  - one step of each engine; the oldest step whose samples are all finished on every engine goes
    to the trainers (gathered on every rank: shares.py); an
    evaluation whose samples are is scored meanwhile, and its metrics go to them once it is;
  - nothing to do -> wait for the next push, an evaluation's request or score, or stop.
Prompts are drawn as the trainer's sampler draws them (same seed, same position: the start the
trainer publishes for this generation of engines), so the trainer checks every step's prompts.
Rollouts in flight when the run stops, or when an engine dies, are dropped: the next
generation, or a resumed run, draws again from the trainer's position (the same prompts and
seeds).

The tokenizer, prompts, engine and SampleProducer (megarl/rollout/producer.py: completions, the
agent loop, a user's) come from the builder colocated runs use (megarl/rollout/builder.py), with
the same settings; the producer runs streamed: several draws in flight, weight updates between
engine steps; with returned routing each sample carries its last request's.

Owns the rollout ranks' side of asynchronous training. Does not own building the rollout side
(builder.py), generation (the producer, turns.py, the engine), the trainer's side
(disaggregated_rollouts.py) or the channel (rollout_ranks/channel.py).
"""

import time
from typing import Optional, Tuple

import torch
import torch.distributed as dist

from megarl.parallel_state.roles import Role
from megarl.planning.resolved import ResolvedRun
from megarl.platform import device_choice
from megarl.resharding.adapter_sync import push_weights
from megarl.rollout.builder import build_rollout_side
from megarl.rollout.prompts import PromptSampler
from megarl.rollout.shares import SharedDraws
from megarl.rollout.turns import TurnDriver
from megarl.rollout_ranks.channel import RolloutChannel, StepRollouts
from megarl.rollout_ranks.evaluation import RolloutEvaluations
from megarl.rollout_ranks.step_draws import StepDraws

WEIGHTS, STOP, GENERATE, WAIT = "weights", "stop", "generate", "wait"


class _Clock:
    """Seconds the rollout side spent per activity since the last step was sent."""

    def __init__(self):
        self.seconds = {}
        self._mark = time.perf_counter()

    def lap(self, activity: str) -> None:
        now = time.perf_counter()
        self.seconds[activity] = self.seconds.get(activity, 0.0) + now - self._mark
        self._mark = now

    def take(self) -> dict:
        out, self.seconds = self.seconds, {}
        return out


def serve(run: ResolvedRun, role: Role) -> None:
    """Generate until the trainer stops the run. Collective over this generation's rollout ranks."""
    config = run.config
    data = config.data
    side = build_rollout_side(run.engine, data, config.generation, sync_first_rank=role.first_rollout_rank)
    tokenizer, prompts, engine, producer = side.tokenizer, side.prompts.prompts, side.engine, side.producer
    channel = RolloutChannel(role.store)
    start = channel.wait_start(role.generation)
    sampler = PromptSampler(len(prompts), data.prompts_per_step, data.seed)
    sampler.load_state_dict(start.sampler_state)
    driver = TurnDriver(engine, config.async_.partial_rollout, version=0)
    draws = SharedDraws(producer, driver)
    evaluations = (RolloutEvaluations(run, tokenizer, channel, draws, leader=role.rank == 0)
                   if run.eval.sets else None)
    steps = StepDraws(config, tokenizer, prompts, sampler, draws, leader=role.rank == 0)
    staleness, bucket = config.async_.max_staleness, config.layout.sync_bucket_mb * 2**20
    version, next_draw, next_send = start.version - 1, start.version + 1, start.version + 1

    def drawable() -> bool:  # the next step, by the staleness bound and its rounds (step_draws.py)
        return next_draw <= config.steps and next_draw - 1 - staleness <= version and steps.can_draw()

    clock = _Clock()
    while True:
        turn = _decide(channel, role.generation, version, drawable(), draws, evaluations)
        if turn == STOP:
            break
        if turn == WEIGHTS:
            if evaluations is not None:
                evaluations.drop()
            driver.pause()
            push_weights([], run.arch, engine, bucket, links=role.bridge)
            version += 1
            driver.weights_updated(version)
            clock.lap("sync_s")
        elif turn == WAIT:
            if role.rank == 0:
                channel.wait_for_weights_or_stop(role.generation, version + 1,
                                                 evaluations.news if evaluations else lambda: False)
            clock.lap("idle_s")
        else:
            while drawable():
                steps.draw(next_draw)
                next_draw += 1
            if evaluations is not None:  # after the training draws: vLLM schedules first come first
                evaluations.start(version)
            draws.step()
            clock.lap("generate_s")
            drawn = steps.finished(next_send)
            if drawn is not None:
                interrupted, discarded = _over_engines(driver)
                if role.rank == 0:
                    channel.put_rollouts(StepRollouts(next_send, *drawn, {
                        **{f"async/rollout_{k}": v for k, v in clock.take().items()},
                        "async/interrupted_requests": interrupted,
                        "async/restart_discarded_tokens": discarded}))
                next_send += 1
            if evaluations is not None:
                evaluations.sampled()
    if evaluations is not None:
        evaluations.close()
    steps.close()
    producer.close()
    engine.shutdown()


def _over_engines(driver: TurnDriver) -> Tuple[int, int]:
    """(requests interrupted at weight pushes, tokens restarts discarded) so far, summed over the
    engines (each counted by its leader). Collective over the rollout world."""
    counts = torch.tensor([driver.interrupted, driver.discarded_tokens] if driver.engine.placement.leader
                          else [0, 0], dtype=torch.int64, device=device_choice.collective_device())
    if dist.get_world_size() > 1:
        dist.all_reduce(counts)
    interrupted, discarded = counts.tolist()
    return interrupted, discarded


def _decide(channel: RolloutChannel, generation: int, version: int, drawable: bool,
            draws: SharedDraws, evaluations: Optional[RolloutEvaluations]) -> str:
    """The rollout leader's choice for this turn, the same on every rank of the rollout world,
    which all take a new evaluation request with it; `drawable`: whether the next step may be
    drawn."""
    choice = [None]
    if dist.get_rank() == 0:
        request = None
        if evaluations is not None:
            evaluations.deliver()
            request = evaluations.new_request()
            if request is not None:
                evaluations.request(*request)
        if channel.weights_announced(generation, version + 1):
            turn = WEIGHTS
        elif (draws.in_flight()  # on some engine, or finished on all but not yet sent
              or drawable
              or (evaluations is not None and evaluations.startable(version))):
            turn = GENERATE
        elif channel.stopping():
            turn = STOP
        else:
            turn = WAIT
        choice[0] = (turn, request)
    if dist.get_world_size() > 1:
        dist.broadcast_object_list(choice, src=0)
    turn, request = choice[0]
    if dist.get_rank() != 0 and request is not None:
        evaluations.request(*request)
    return turn
