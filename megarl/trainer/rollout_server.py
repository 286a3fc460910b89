"""What rollout ranks run in a disaggregated job: one vLLM engine generating the next steps'
rollouts while the trainer ranks train, with weights at most async.max_staleness versions old.

The loop, on every rank of the engine in lockstep (the engine leader decides each turn and tells
the others, so their vLLM schedulers see the same calls):
  - a weight push announced -> join it over the bridge; unfinished requests continue (or restart)
    with the new weights (megarl/rollout/turns.py);
  - step n may be drawn once the engine holds version >= n - 1 - max_staleness (its samples are
    then never older than that when step n trains on version n - 1); draw it (step_draws.py; with
    dynamic sampling, once the steps before it have all their rounds);
  - an evaluation requested (held-out sets) -> its draws go in after the training draws its
    weights allow (rollout_evaluation.py); a push drops and restarts one in flight;
  - one engine step; the oldest step whose samples are all finished goes to the trainers; an
    evaluation whose samples are is scored meanwhile, and its metrics go to them once it is;
  - nothing to do -> wait for the next push, an evaluation's request or score, or stop.
Prompts are drawn as the trainer's sampler draws them (same seed, same position: the start the
trainer publishes for this generation of engines), so the trainer checks every step's prompts.
Rollouts in flight when the run stops, or when this engine dies, are dropped: the next
generation, or a resumed run, draws again from the trainer's position (the same prompts and
seeds).

The tokenizer, prompts, engine and SampleProducer (megarl/rollout/producer.py: completions, the
agent loop, a user's) come from the builder colocated runs use (megarl/rollout/builder.py), with
the same settings; the producer runs streamed: several draws in flight, weight updates between
engine steps; with returned routing each sample carries its last request's.

Owns the rollout ranks' side of asynchronous training. Does not own building the rollout side
(builder.py), generation (the producer, turns.py, the engine), the trainer's side
(disaggregated_rollouts.py) or the channel (rollout_channel.py).
"""

import time
from typing import Optional

import torch.distributed as dist

from megarl.models.hf_config import arch_from_hf_config, load_hf_config
from megarl.parallel_state.roles import Role
from megarl.resharding.sync import sync_weights
from megarl.rollout.builder import build_rollout_side
from megarl.rollout.producer import SampleProducer
from megarl.rollout.prompts import PromptSampler
from megarl.rollout.turns import TurnDriver
from megarl.trainer.config import RunConfig
from megarl.trainer.rollout_channel import RolloutChannel, StepRollouts
from megarl.trainer.rollout_evaluation import RolloutEvaluations
from megarl.trainer.step_draws import StepDraws

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


def serve(config: RunConfig, role: Role) -> None:
    """Generate until the trainer stops the run. Collective over this generation's rollout ranks."""
    data = config.data
    arch = arch_from_hf_config(load_hf_config(config.model.hf_dir))
    side = build_rollout_side(config.engine_spec(arch.dtype), data, config.generation,
                              sync_first_rank=role.first_rollout_rank)
    tokenizer, prompts, engine, producer = side.tokenizer, side.prompts.prompts, side.engine, side.producer
    channel = RolloutChannel(role.store)
    start = channel.wait_start(role.generation)
    sampler = PromptSampler(len(prompts), data.prompts_per_step, data.seed)
    sampler.load_state_dict(start.sampler_state)
    driver = TurnDriver(engine, config.async_.partial_rollout, version=0)
    evaluations = (RolloutEvaluations(config, tokenizer, channel, producer, driver, leader=role.rank == 0)
                   if config.eval.sets else None)
    steps = StepDraws(config, tokenizer, prompts, sampler, producer, driver, leader=role.rank == 0)
    staleness, bucket = config.async_.max_staleness, config.layout.sync_bucket_mb * 2**20
    version, next_draw, next_send = start.version - 1, start.version + 1, start.version + 1

    def drawable() -> bool:  # the next step, by the staleness bound and its rounds (step_draws.py)
        return next_draw <= config.steps and next_draw - 1 - staleness <= version and steps.can_draw()

    clock = _Clock()
    while True:
        turn = _decide(channel, role.generation, version, drawable(), producer, evaluations)
        if turn == STOP:
            break
        if turn == WEIGHTS:
            if evaluations is not None:
                evaluations.drop()
            driver.pause()
            sync_weights([], arch, engine, bucket, links=role.bridge)
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
            if producer.busy():
                producer.step(driver)
            clock.lap("generate_s")
            drawn = steps.finished(next_send)
            if drawn is not None:
                if role.rank == 0:
                    channel.put_rollouts(StepRollouts(next_send, *drawn, {
                        **{f"async/rollout_{k}": v for k, v in clock.take().items()},
                        "async/interrupted_requests": driver.interrupted,
                        "async/restart_discarded_tokens": driver.discarded_tokens}))
                next_send += 1
            if evaluations is not None:
                evaluations.sampled()
    if evaluations is not None:
        evaluations.close()
    steps.close()
    producer.close()
    engine.shutdown()


def _decide(channel: RolloutChannel, generation: int, version: int, drawable: bool,
            producer: SampleProducer, evaluations: Optional[RolloutEvaluations]) -> str:
    """The engine leader's choice for this turn, the same on every rank of the engine, which all
    take a new evaluation request with it; `drawable`: whether the next step may be drawn."""
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
        elif (producer.busy() or producer.draws_in_flight()  # in flight, or finished but not yet sent
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
