"""The rollout ranks' draws of training steps (rollout_ranks/server.py): each step's prompts drawn as the
trainer's sampler draws them, and with DAPO dynamic sampling (algo.dynamic_sampling_rounds) its
extra rounds, decided on the rollout side as the colocated loop decides them
(dynamic_sampling.rounds_wanted), so the trainer receives a step's rounds whole and keeps its
informative groups as a colocated step would (rollout_source.step_rollouts).

Why a step's rounds are decided before the next step draws: the rounds come from the sampler in
the trainer's order (step n's rounds, then step n+1's), the order checkpoints save and a resumed
run or a replaced engine continues from. So with dynamic sampling the engine generates one step's
rounds at a time (still while the trainer trains earlier steps). The engine leader judges a
finished round with a Scorer of its own over the training reward table (a pool of
algo.reward_workers), and every rank of the engine takes its decision in the same turn; the
trainer scores the rounds again with its own, so a reward must give the same number for the same
response (reward models, which run on the trainer ranks, are refused here: config.py).

With several engines on the rollout ranks each round is split over them (shares.SharedDraws): a
round is finished once every engine's share is, and every rank then holds all its samples.

Owns which prompts each step's rounds sample and when a step is complete. Does not own generation
(the producer), the split over engines (shares.py), the weights (rollout_ranks/server.py) or what the
trainer keeps (rollout_source.py).
"""

from typing import Dict, List, Optional, Tuple

import torch.distributed as dist

from megarl.planning.config import RunConfig
from megarl.rewards.scorer import Scorer
from megarl.rollout.collect import Collected, scored
from megarl.rollout.engine import RolloutSample
from megarl.rollout.prompts import Prompt, PromptSampler
from megarl.rollout.shares import SharedDraws
from megarl.rollout_ranks.dynamic_sampling import rounds_wanted, step_sampling


def _draw(step: int, round_: int):
    """Round `round_` of step `step`'s producer draw (round 0: the step's number, as without
    dynamic sampling)."""
    return step if round_ == 0 else f"step{step}/round{round_}"


class StepDraws:
    def __init__(self, config: RunConfig, tokenizer, prompts: List[Prompt], sampler: PromptSampler,
                 draws: SharedDraws, leader: bool):
        algo = config.algo
        self.config, self.tokenizer, self.prompts, self.sampler = config, tokenizer, prompts, sampler
        self.draws = draws
        self.extra_rounds, self.wanted = algo.dynamic_sampling_rounds, config.data.prompts_per_step
        self.judge = (Scorer(algo.reward_table, algo.reward_workers, algo.reward_timeout_s, collective=False)
                      if leader and self.extra_rounds else None)
        self.rounds: Dict[int, List[List[int]]] = {}  # step -> its rounds' prompt indices so far
        self.sampled: Dict[int, List[List[RolloutSample]]] = {}  # step -> its finished rounds' samples
        self.judged: Dict[int, List[Collected]] = {}  # the leader's: step -> its finished rounds, scored
        self.undecided: Optional[int] = None  # the step whose rounds are not all drawn yet

    def can_draw(self) -> bool:
        """Whether the next step may be drawn now: with dynamic sampling, once the steps drawn
        have all their rounds (module docstring)."""
        return self.undecided is None

    def draw(self, step: int) -> None:
        self.rounds[step], self.sampled[step], self.judged[step] = [], [], []
        self._draw_round(step)
        if self.extra_rounds:
            self.undecided = step

    def _draw_round(self, step: int) -> None:
        indices = self.sampler.next_batch()
        round_ = len(self.rounds[step])
        self.rounds[step].append(indices)
        self.draws.start(_draw(step, round_), [self.prompts[i] for i in indices],
                         step_sampling(self.config, self.tokenizer, step, round_))

    def finished(self, step: int) -> Optional[Tuple[List[List[int]], List[List[RolloutSample]]]]:
        """(each round's prompt indices, each round's samples) of step `step` once all its rounds
        are drawn and sampled, else None; with dynamic sampling, a round just finished draws the
        next where rounds_wanted says so. Every rank of the rollout world in the same turn
        (collective over them: SharedDraws.finished, and the judgement with dynamic sampling)."""
        if step not in self.rounds:
            return None
        round_ = len(self.sampled[step])
        samples = self.draws.finished(_draw(step, round_))
        if samples is None:
            return None
        self.sampled[step].append(samples)
        if self.extra_rounds:
            if self._another_round(step, samples):
                self._draw_round(step)
                return None
            self.undecided = None
        del self.judged[step]
        return self.rounds.pop(step), self.sampled.pop(step)

    def _another_round(self, step: int, samples: List[RolloutSample]) -> bool:
        """The leader's judgement of the step's rounds so far, on every rank."""
        box = [None]
        if self.judge is not None:
            asked = [self.prompts[i] for i in self.rounds[step][-1]]
            self.judged[step].append(scored(samples, asked, self.tokenizer, self.judge))
            box[0] = rounds_wanted(self.judged[step], self.extra_rounds, self.wanted)
        if dist.get_world_size() > 1:
            dist.broadcast_object_list(box, src=0)
        return box[0]

    def close(self) -> None:
        if self.judge is not None:
            self.judge.close()
