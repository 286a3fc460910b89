"""The `completion` producer: one turn per sample, the engine's completion of the prompt.

Every sample is its own request (n=1, seeded by engine.sample_seed: the seeds engine.generate's
one request per prompt gives its n samples), so a draw that no weight update interrupts samples
exactly what engine.generate samples. Owns nothing but that; the turns' life in the engine
(interrupts, versions, routing) is turns.py's.
"""

from dataclasses import dataclass, replace
from typing import Optional, Sequence

import torch

from megarl.rollout.draws import Draw, Draws
from megarl.rollout.engine import RolloutSample, SamplingConfig, sample_seed
from megarl.rollout.prompts import Prompt
from megarl.rollout.turns import Turn, TurnDriver


@dataclass(eq=False)
class _Sample:
    prompt_index: int
    turn: Turn

    @property
    def done(self) -> bool:
        return self.turn.done

    def live_turn(self) -> Optional[Turn]:
        return None if self.turn.done else self.turn

    def sample(self, versions: bool) -> RolloutSample:
        turn = self.turn
        return RolloutSample(turn.context, turn.tokens, torch.tensor(turn.logprobs, dtype=torch.float32),
                             self.prompt_index, turn.finish_reason, routed_experts=turn.routed_experts,
                             versions=torch.tensor(turn.versions, dtype=torch.int64) if versions else None)


class Completion(Draws[_Sample]):
    def start(self, driver: TurnDriver, draw: Draw, prompts: Sequence[Prompt],
              sampling: SamplingConfig) -> None:
        samples = [_Sample(index, Turn(list(prompt.token_ids),
                                       replace(sampling, n=1, seed=sample_seed(sampling, index, j))))
                   for index, prompt in enumerate(prompts) for j in range(sampling.n)]
        self._add(draw, samples)
        for sample in samples:
            driver.submit(sample.turn)

    def step(self, driver: TurnDriver) -> None:
        driver.step()

    def close(self) -> None:
        pass
