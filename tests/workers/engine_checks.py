"""Worker: one vLLM engine on a tiny model (its checkpoint's weights), for what needs an engine and
no trainer: (1) sampling parameters reach vLLM; then (2) an update begun with a plan whose shape is
wrong is refused, and (3) one that writes every engine tensor except the MLP input projections
fails the completeness check (vLLM itself would accept it silently). One launch: starting an
engine costs far more here than any of these. Prints one JSON object of observations; the
refusals' messages under "refused_plan" and "incomplete_update"."""

import argparse
import json

from megarl.models.hf.config import load_arch
from megarl.models.weights.destination import RolloutLayout, vllm_layout
from megarl.rollout.engine import SamplingConfig, check_update
from megarl.rollout.vllm.engine import VLLMEngine


def sampling_observations(engine: VLLMEngine) -> dict:
    prompts = [[1, 2, 3, 4], [9, 8, 7]]
    greedy = SamplingConfig(n=1, temperature=0.0, max_new_tokens=6)
    first = engine.generate(prompts, greedy)
    again = engine.generate(prompts, greedy)
    stop = first[0].response_ids[2]
    stopped = engine.generate(prompts[:1], SamplingConfig(temperature=0.0, max_new_tokens=6,
                                                          stop_token_ids=(stop,)))
    sampled = engine.generate(prompts, SamplingConfig(n=3, temperature=1.0, top_p=0.9, top_k=20,
                                                      max_new_tokens=5, seed=7))
    resampled = engine.generate(prompts, SamplingConfig(n=3, temperature=1.0, top_p=0.9, top_k=20,
                                                        max_new_tokens=5, seed=7))
    # The same prompt twice in one draw: each copy has seeds of its own (engine.sample_seed), so
    # its samples are its own; the second copy's equal a request of its own seeded past the first's.
    twins = engine.generate([[5, 6, 7], [5, 6, 7]], SamplingConfig(n=2, max_new_tokens=12, seed=3))
    second = engine.generate([[5, 6, 7]], SamplingConfig(n=2, max_new_tokens=12, seed=3 + 2))
    return {
        "twin_responses": [[s.response_ids for s in twins if s.prompt_index == i] for i in range(2)],
        "second_alone": [s.response_ids for s in second],
        "greedy_repeatable": [s.response_ids for s in first] == [s.response_ids for s in again],
        "greedy_lengths": [len(s.response_ids) for s in first],
        "logprob_lengths_match": all(len(s.logprobs) == len(s.response_ids) for s in sampled),
        "stop_token": stop, "greedy_first": first[0].response_ids,
        "stopped": stopped[0].response_ids, "stopped_reason": stopped[0].finish_reason,
        "samples_per_prompt": [sum(s.prompt_index == i for s in sampled) for i in range(2)],
        "seeded_repeatable": [s.response_ids for s in sampled] == [s.response_ids for s in resampled],
        "prompt_ids": [s.prompt_ids for s in first],
    }


def refused_updates(engine: VLLMEngine, hf_dir: str) -> dict:
    """What the engine said to a mis-shaped plan and to an update that left tensors unwritten
    ("" where it said nothing)."""
    said = {"refused_plan": "", "incomplete_update": ""}
    tensors = vllm_layout(load_arch(hf_dir), RolloutLayout(1), 1)[0]
    expected = {t.name: t.shape for t in tensors}
    wrong = dict(expected, **{"model.norm.weight": (3,)})
    try:
        engine.begin_weight_update(wrong)
    except ValueError as error:
        said["refused_plan"] = str(error)
    engine.begin_weight_update(expected)
    for tensor in tensors:
        if "gate_up_proj" not in tensor.name:
            engine.open_tensors([tensor.name])[tensor.name].zero_()
            engine.close_tensors([tensor.name])
    try:
        check_update(engine.finish_weight_update())
    except RuntimeError as error:
        said["incomplete_update"] = str(error)
    return said


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--hf-dir", required=True)
    args = parser.parse_args()
    engine = VLLMEngine(args.hf_dir, load_format="auto")  # no sync before sampling: the checkpoint's weights
    seen = sampling_observations(engine)
    seen.update(refused_updates(engine, args.hf_dir))  # last: it zeroes the weights
    print(json.dumps(seen))
    engine.shutdown()


if __name__ == "__main__":
    main()
