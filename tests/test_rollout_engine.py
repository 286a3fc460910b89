"""The vLLM engine's generate honours the sampling parameters (real vLLM, tiny model); every
sample of a run is seeded apart."""

from types import SimpleNamespace

import pytest

from megarl.planning.config import RunConfig
from megarl.planning.typed_config import load
from megarl.rollout.engine import Placement, SamplingConfig, sample_seed
from megarl.rollout.shares import share
from megarl.rollout.vllm.engine import rollout_groups
from megarl.rollout_ranks.dynamic_sampling import step_sampling


def test_sampling_parameters_reach_vllm(engine_checks):
    seen = engine_checks
    assert seen["greedy_repeatable"] and seen["seeded_repeatable"]
    assert seen["greedy_lengths"] == [6, 6]
    assert seen["logprob_lengths_match"]
    assert seen["samples_per_prompt"] == [3, 3]
    assert seen["prompt_ids"] == [[1, 2, 3, 4], [9, 8, 7]]
    first_stop = seen["greedy_first"].index(seen["stop_token"])
    assert seen["stopped"] == seen["greedy_first"][:first_stop + 1]
    assert seen["stopped_reason"] == "stop"
    first, second = seen["twin_responses"]
    assert first != second and second == seen["second_alone"], seen


def test_every_sample_of_every_draw_has_its_own_seed():
    """One seed per sample across prompts, rounds and steps, and the same seeds whichever engine
    of a job serves a prompt (shares.share offsets a share by its first prompt)."""
    config = load(RunConfig, "configs/demo_cpu.yaml", ["algo.dynamic_sampling_rounds=2"])
    tokenizer = SimpleNamespace(eos_token_id=0)
    prompts, n = config.data.prompts_per_step, config.generation.samples_per_prompt
    seeds = [sample_seed(step_sampling(config, tokenizer, step, round_), p, j)
             for step in range(1, 5) for round_ in range(3) for p in range(prompts) for j in range(n)]
    assert len(set(seeds)) == len(seeds)
    draw = step_sampling(config, tokenizer, 3)
    for engines in (1, 2, 3, 5):
        served = []
        for rank in range(engines):
            mine, sampling = share(Placement(engines, rank, True), prompts, draw)
            served += [(i, sample_seed(sampling, p, j)) for p, i in enumerate(mine) for j in range(n)]
        assert served == [(i, sample_seed(draw, i, j)) for i in range(prompts) for j in range(n)], engines


@pytest.mark.parametrize("kwargs,message", [
    (dict(n=0), "n must be >= 1"), (dict(top_p=0.0), r"top_p must be in \(0, 1\]"),
    (dict(top_k=0), "top_k must be -1"), (dict(max_new_tokens=0), "max_new_tokens"),
])
def test_bad_sampling_config(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingConfig(**kwargs)


def test_rollout_tp_must_divide_world():
    assert rollout_groups(4, 2) == 2
    with pytest.raises(ValueError, match=r"rollout tp 3 must divide the world size 4.*\[1, 2, 4\]"):
        rollout_groups(4, 3)
