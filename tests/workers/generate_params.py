"""Worker: sampling parameters reach vLLM. Prints one JSON object of observations."""

import argparse
import json

from megarl.rollout.engine import SamplingConfig
from megarl.rollout.vllm_engine import VLLMEngine


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--hf-dir", required=True)
    args = parser.parse_args()
    engine = VLLMEngine(args.hf_dir, load_format="auto")  # no sync here: the checkpoint's weights
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
    print(json.dumps({
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
    }))
    engine.shutdown()


if __name__ == "__main__":
    main()
