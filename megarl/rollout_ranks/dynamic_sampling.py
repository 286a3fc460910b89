"""The rules that decide what a step samples, shared by both placements of the engines: the
step's sampling seed (fixed by the step and round, so a resumed run or the other rollout source
samples the same) and DAPO's dynamic sampling (draw another round while too few groups are
informative). The colocated source (trainer/rollout_source.py) and the rollout ranks' draws
(step_draws.py) decide by these same functions, so both draw the same rounds.
"""

from typing import Sequence

import torch

from megarl.algos.shaping import informative_groups
from megarl.planning.config import RunConfig
from megarl.rollout.collect import Collected
from megarl.rollout.engine import SamplingConfig


def step_sampling(config: RunConfig, tokenizer, number: int, round_: int = 0) -> SamplingConfig:
    """How step `number` samples (its `round_`-th round with dynamic sampling): its seed is fixed
    by the step, so a resumed run, or another rollout source, samples the same."""
    gen = config.generation
    # Every sample of every round of every step its own seed (engine.sample_seed spans a draw).
    draw = number * (config.algo.dynamic_sampling_rounds + 1) + round_
    seed = config.seed + draw * config.data.prompts_per_step * gen.samples_per_prompt
    return SamplingConfig(n=gen.samples_per_prompt, temperature=gen.temperature, top_p=gen.top_p,
                          max_new_tokens=gen.max_new_tokens, stop_token_ids=(tokenizer.eos_token_id,),
                          seed=seed)


def informative_count(part: Collected) -> int:
    """The groups of one round whose rewards differ (DAPO keeps those)."""
    batch = part.batch
    return len(torch.unique(batch.group_ids[informative_groups(batch.rewards, batch.group_ids)]))


def rounds_wanted(parts: Sequence[Collected], extra_rounds: int, wanted: int) -> bool:
    """Whether a step whose rounds so far are `parts` draws another: with dynamic sampling
    (extra_rounds > 0), while fewer than `wanted` groups were informative and rounds are left.
    The rollout ranks decide by it too, so both placements draw the same rounds."""
    return 0 < len(parts) <= extra_rounds and sum(map(informative_count, parts)) < wanted
