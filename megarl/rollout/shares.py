"""Draws split over the engines of a world: each engine samples a contiguous share of a draw's
prompts (engine.Placement.share) with the seeds those prompts have in the whole draw, and every
rank receives every engine's samples in prompt order. So a draw's samples do not depend on how
many engines sampled it, only on its prompts and seed.

The colocated collection drives one draw at a time to its end (collect.all_samples); the rollout
ranks' server keeps several streamed draws in flight on every engine at once (SharedDraws): an
engine that finishes its share of a draw keeps it until every engine has finished its own, and
then every rank of the world takes the whole draw in the same turn.

Owns the shares and the gathers. Does not own generation (the producer, turns.py) or scoring.
"""

from dataclasses import replace
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from megarl.platform import device_choice
from megarl.rollout.draws import Draw
from megarl.rollout.engine import Placement, RolloutSample, SamplingConfig, sample_seed
from megarl.rollout.producer import SampleProducer
from megarl.rollout.prompts import Prompt
from megarl.rollout.turns import TurnDriver


def share(placement: Placement, count: int, sampling: SamplingConfig) -> Tuple[List[int], SamplingConfig]:
    """(the draw's prompt indices this rank's engine samples, the sampling that gives them their
    seeds in the whole draw: engine.sample_seed)."""
    mine = placement.share(count)
    if mine and sampling.seed is not None:
        sampling = replace(sampling, seed=sample_seed(sampling, mine[0], 0))
    return mine, sampling


def gathered(placement: Placement, mine: Sequence[int], samples: List[RolloutSample]) -> List[RolloutSample]:
    """Every engine's samples on every rank, ordered by the draw's prompt index; `samples`: this
    engine's, of the prompts `mine` (their prompt_index into `mine`). Collective over the world."""
    for sample in samples:
        sample.prompt_index = mine[sample.prompt_index]
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, samples if placement.leader else [])
    every = [s for part in parts for s in part]
    return sorted(every, key=lambda s: s.prompt_index)  # stable: keeps each prompt's sample order


def _everywhere(flag: bool) -> bool:
    """Whether `flag` holds on every rank of the world. Collective."""
    value = torch.tensor([int(flag)], dtype=torch.int32, device=device_choice.collective_device())
    dist.all_reduce(value, op=dist.ReduceOp.MIN)
    return bool(value.item())


class SharedDraws:
    """A producer's streamed draws, each split over the world's engines. Every rank calls each
    method in the same turn (the rollout server's loop is in lockstep): `finished` is collective."""

    def __init__(self, producer: SampleProducer, driver: TurnDriver):
        self.producer, self.driver = producer, driver
        self.placement: Placement = driver.engine.placement
        self._mine: Dict[Draw, List[int]] = {}  # draws in flight -> this engine's share
        self._done: Dict[Draw, List[RolloutSample]] = {}  # this engine's finished shares

    def start(self, draw: Draw, prompts: Sequence[Prompt], sampling: SamplingConfig) -> None:
        mine, sampling = share(self.placement, len(prompts), sampling)
        self._mine[draw] = mine
        if mine:
            self.producer.start(self.driver, draw, [prompts[i] for i in mine], sampling)
        else:  # more engines than prompts: this one has none of them
            self._done[draw] = []

    def step(self) -> None:
        """One step of this engine (and its producer's tool calls) when its shares need it."""
        if self.producer.busy():
            self.producer.step(self.driver)

    def finished(self, draw: Draw) -> Optional[List[RolloutSample]]:
        """The whole draw's samples (prompt order, then sample order) once every engine's share is
        finished, else None. Collective over the world when it holds several engines (with one,
        its share is the whole draw, already on every rank: nothing to gather)."""
        if draw not in self._mine:
            return None
        if draw not in self._done:
            samples = self.producer.finished(self.driver, draw)
            if samples is not None:
                self._done[draw] = samples
        ready = draw in self._done
        if self.placement.engines > 1:
            ready = _everywhere(ready)
        if not ready:
            return None
        mine, samples = self._mine.pop(draw), self._done.pop(draw)
        if self.placement.engines == 1:  # every rank holds its engine's samples, of the whole draw
            return samples
        return gathered(self.placement, mine, samples)

    def drop(self, draw: Draw) -> None:
        """Forget `draw` on this engine, aborting what its share has in flight."""
        if self._mine.pop(draw, None) is not None and self._done.pop(draw, None) is None:
            self.producer.drop(self.driver, draw)

    def in_flight(self) -> int:
        """Draws started and not yet taken or dropped: the same number on every rank."""
        return len(self._mine)
