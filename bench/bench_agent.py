"""Multi-turn rollouts with every conversation in flight against one turn at a time in lockstep.

  python bench/bench_agent.py [--quick] [--conversations N]

The workload: N conversations (64) on the demo model (prepare_demo.py --hf-only) whose environment
(bench/slow_env.py, an interaction run in the tool pool) lasts 1-8 turns, uneven by conversation,
and answers in 0.05 s except for one step in eight, which takes 2 s (seeded). Both modes use the
same vLLM engine and a pool of N worker processes, so every environment step could run at once:
  in flight: megarl's AgentLoop, each conversation's next turn submitted as soon as its step is in;
  lockstep:  every live conversation's turn generated as one batch, then every step, then the next
             turn (what a loop that batches turn by turn does).
Both end with the same turns per conversation (checked). Prints one JSON object; target:
in-flight seconds < lockstep seconds / 2.
"""

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "bench")]  # megarl, and slow_env for the pool's workers

from slow_env import QUICK_S, SLOW_S  # noqa: E402

from megarl.rollout.agent_loop import AgentConfig, AgentLoop  # noqa: E402
from megarl.rollout.chat_insert import first_prompt_ids, inserted_ids  # noqa: E402
from megarl.rollout.engine import SamplingConfig  # noqa: E402
from megarl.rollout.prompts import load_prompts  # noqa: E402

ENV = "slow_env:step"
TARGET_SPEEDUP = 2.0
SAMPLING = SamplingConfig(n=1, temperature=1.0, max_new_tokens=64, seed=0)


def _workload(prompts, count: int, seed: int):
    """`count` prompts, each with its conversation's turns and slow steps in extra_info."""
    rng = random.Random(seed)
    chosen = []
    for prompt in prompts[:count]:
        turns = rng.randint(1, 8)
        slow = [t for t in range(1, turns + 1) if rng.random() < 1 / 8]
        chosen.append(type(prompt)(prompt.text, prompt.token_ids, prompt.answer, prompt.data_source,
                                   {"interaction_kwargs": {"turns": turns, "slow_turns": slow}},
                                   prompt.messages))
    return chosen


def _lockstep(engine, tokenizer, prompts, pool) -> list:
    """Turns per conversation, generated a turn at a time for all of them together."""
    ids = [first_prompt_ids(tokenizer, p.messages) for p in prompts]
    response = [[] for _ in prompts]
    messages = [list(p.messages) for p in prompts]
    turns = [0] * len(prompts)
    last = [[] for _ in prompts]  # each conversation's last generated turn
    alive = list(range(len(prompts)))
    while alive:
        samples = engine.generate([ids[i] + response[i] for i in alive], SAMPLING)
        for i, sample in zip(alive, samples):
            last[i] = sample.response_ids
            response[i] += sample.response_ids
            turns[i] += 1
            messages[i].append({"role": "assistant", "content": tokenizer.decode(sample.response_ids,
                                                                                 skip_special_tokens=True)})
        replies = pool.map([(ENV, ("interaction", (messages[i], prompts[i].extra_info["interaction_kwargs"])))
                            for i in alive])
        going = []
        for i, reply in zip(alive, replies):
            if reply.value is None:
                raise RuntimeError(f"the environment failed: {reply.error}")
            if reply.value.get("done"):
                continue
            turn = [{"role": "user", "content": reply.value["content"]}]
            response[i] += inserted_ids(tokenizer, last[i], turn)
            messages[i] += turn
            going.append(i)
        alive = going
    return turns


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="(the same workload: it takes ~1 min)")
    parser.add_argument("--conversations", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    import transformers

    from megarl.rollout.vllm_engine import VLLMEngine

    with tempfile.TemporaryDirectory() as inputs:
        subprocess.run([sys.executable, "scripts/prepare_demo.py", "--out", inputs, "--hf-only",
                        "--prompts", str(args.conversations)], cwd=ROOT, check=True, stdout=sys.stderr)
        model = os.path.join(inputs, "model")
        tokenizer = transformers.AutoTokenizer.from_pretrained(model)
        prompts = _workload(load_prompts(os.path.join(inputs, "train.jsonl"), tokenizer, 64).prompts,
                            args.conversations, args.seed)
        engine = VLLMEngine(model, load_format="auto", dtype="float32", max_model_len=256)
        engine.generate([p.token_ids for p in prompts], SAMPLING)  # warm-up
        # max_turns above the longest conversation: both modes run every environment step, the last too
        config = AgentConfig(interaction=ENV, max_turns=9, tool_workers=args.conversations, tool_timeout_s=60)
        loop = AgentLoop(tokenizer, config)
        loop.pool.map([(ENV, ("interaction", ([], {"turns": 0, "quick_s": 0.0})))] * args.conversations)
        start = time.monotonic()
        in_flight = [s.events["turns"] for s in loop.produce(engine, prompts, SAMPLING)]
        in_flight_s = time.monotonic() - start
        start = time.monotonic()
        lockstep = _lockstep(engine, tokenizer, prompts, loop.pool)
        lockstep_s = time.monotonic() - start
        loop.close()
    expected = [p.extra_info["interaction_kwargs"]["turns"] for p in prompts]
    if in_flight != expected or lockstep != expected:
        raise RuntimeError(f"turns differ from the workload's: {in_flight} / {lockstep} / {expected}")
    speedup = lockstep_s / in_flight_s
    # The environment's own seconds, generation left out: in flight, the slowest conversation's
    # steps; in lockstep, each wave's slowest step, summed over the waves.
    kwargs = [p.extra_info["interaction_kwargs"] for p in prompts]
    latency = [[SLOW_S if t in k["slow_turns"] else QUICK_S for t in range(1, k["turns"] + 1)]
               for k in kwargs]
    in_flight_floor = max(sum(steps) for steps in latency)
    lockstep_floor = sum(max(steps[k] for steps in latency if len(steps) > k)
                         for k in range(max(map(len, latency))))
    print(json.dumps({
        "conversations": args.conversations, "turns_total": sum(expected),
        "turns_per_conversation": {str(k): expected.count(k) for k in sorted(set(expected))},
        "slow_steps": sum(len(p.extra_info["interaction_kwargs"]["slow_turns"]) for p in prompts),
        "in_flight_s": round(in_flight_s, 2), "lockstep_s": round(lockstep_s, 2),
        "in_flight_floor_s": round(in_flight_floor, 2), "lockstep_floor_s": round(lockstep_floor, 2),
        "speedup": round(speedup, 2),
        "target_speedup": TARGET_SPEEDUP, "passed": speedup >= TARGET_SPEEDUP}))


if __name__ == "__main__":
    main()
