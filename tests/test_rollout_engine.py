"""The vLLM engine's generate honours the sampling parameters (real vLLM, tiny model)."""

import pytest

from megarl.rollout.engine import SamplingConfig
from megarl.rollout.vllm_engine import rollout_groups
from tests.launch import last_json, run


def test_sampling_parameters_reach_vllm(hf_models):
    seen = last_json(run("tests/workers/generate_params.py", "--hf-dir", hf_models["qwen3"]))
    assert seen["greedy_repeatable"] and seen["seeded_repeatable"]
    assert seen["greedy_lengths"] == [6, 6]
    assert seen["logprob_lengths_match"]
    assert seen["samples_per_prompt"] == [3, 3]
    assert seen["prompt_ids"] == [[1, 2, 3, 4], [9, 8, 7]]
    first_stop = seen["greedy_first"].index(seen["stop_token"])
    assert seen["stopped"] == seen["greedy_first"][:first_stop + 1]
    assert seen["stopped_reason"] == "stop"


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
