"""Worker: the agent loop on a real vLLM engine with the scripted tool-calling model
(tests/scripted_agent.py). The engine is tapped: every request submitted and every request's
generated ids are recorded as vLLM reported them, step by step. Prints one JSON object: the
samples (token ids, loss mask, log-probs, trajectory, events), the tapped requests, the tool
schemas and the seconds the produce call took."""

import argparse
import json
import time

import transformers

from megarl.rollout.agent.loop import AgentConfig, AgentLoop
from megarl.rollout.engine import SamplingConfig
from megarl.rollout.producer import produce
from megarl.rollout.prompts import Prompt
from megarl.rollout.turns import TurnDriver
from megarl.rollout.vllm.engine import VLLMEngine


class Tapped:
    """The real engine, its requests and finished outputs recorded on the way through."""

    def __init__(self, engine):
        self.engine, self.submitted, self.generated = engine, {}, {}
        self.placement, self.abort, self.from_leader = engine.placement, engine.abort, engine.from_leader

    def submit(self, request_id, prompt_ids, sampling):
        self.submitted[request_id] = list(prompt_ids)
        self.engine.submit(request_id, prompt_ids, sampling)

    def step(self):
        progressed = self.engine.step()
        for progress in progressed:  # each step's new ids
            self.generated.setdefault(progress.request_id, []).extend(progress.token_ids)
        return progressed


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--modes", default="ok,raise,hang,big,single")
    args = parser.parse_args()
    tokenizer = transformers.AutoTokenizer.from_pretrained(args.model_dir)
    engine = Tapped(VLLMEngine(args.model_dir, load_format="auto", dtype="float32", max_model_len=512))
    question = [{"role": "user", "content": "What is 2 + 3 ?"}]
    prompts = []
    for mode in args.modes.split(","):
        # verl's layouts: agent_name, and tools_kwargs with create_kwargs (one record) or plain
        extra = ({"agent_name": "single_turn_agent"} if mode == "single"
                 else {"tools_kwargs": {"calculator": {"create_kwargs": {"mode": mode}}}} if mode == "raise"
                 else {"tools_kwargs": {"calculator": {"mode": mode}}})
        prompts.append(Prompt("", [], "5", "test", extra, tuple(question)))
    loop = AgentLoop(tokenizer, AgentConfig(tools=("tests.agent_tools:calculator",), max_turns=3,
                                            max_tool_output_chars=100, tool_timeout_s=2.0, tool_workers=2))
    start = time.monotonic()
    samples = produce(loop, TurnDriver(engine), prompts,
                      SamplingConfig(n=2, temperature=1.0, max_new_tokens=96, seed=0))
    seconds = time.monotonic() - start
    loop.close()
    print(json.dumps({
        "seconds": seconds, "schemas": loop.schemas,
        "requests": [{"prompt": engine.submitted[r], "generated": engine.generated[r]}
                     for r in engine.submitted],
        "samples": [{"prompt_ids": s.prompt_ids, "response_ids": s.response_ids,
                     "mask": s.response_mask.tolist(), "logprobs": s.logprobs.tolist(),
                     "prompt_index": s.prompt_index,
                     "finish_reason": s.finish_reason, "trajectory": s.trajectory, "events": s.events}
                    for s in samples]}))


if __name__ == "__main__":
    main()
