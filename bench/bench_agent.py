"""Multi-turn rollouts with every conversation in flight against one turn at a time in lockstep,
on waiting (a slow environment) and on work (CPU-bound code in the python sandbox tool).

  python bench/bench_agent.py [--quick] [--conversations N] [--python-conversations M] [--python-turns T]
                              [--inputs DIR] [--sandbox-calls K] [--sandbox-only]

Both cases run on the demo model (prepare_demo.py --hf-only; --inputs: a folder it made already) in
one vLLM engine, with a pool of one worker process per conversation, so every environment step or
tool call could run at once:
  in flight: megarl's AgentLoop, each conversation's next turn submitted as soon as its step is in;
  lockstep:  every live conversation's turn generated as one batch, then every step, then the next
             turn (what a loop that batches turn by turn does).
Cases, one JSON object each:
  slow_env  N conversations (64) whose environment (bench/slow_env.py, an interaction) lasts 1-8
            turns, uneven by conversation, and answers in 0.05 s except for one step in eight,
            which takes 2 s (seeded). Target: in-flight seconds < lockstep seconds / 2.
  python    M conversations (32) of T turns (3) whose every turn but the last calls megarl's
            built-in python tool (a sandboxed interpreter) on a pure-Python loop of 20-300 ms,
            uneven by conversation (bench/python_workload.py). This is CPU work: both modes are
            bounded below by the tools' core-seconds over the cores, so in flight can save only
            the cores' idle time at each wave's end and the generation it overlaps with tools.
  sandbox_call  K calls (30) of the python tool on `print(1)`, one at a time, each a fresh
            interpreter: the sandbox (bubblewrap: sandbox.py) against the tool as it was before
            issue 54 (`unshare -rn` and rlimits in a temporary folder, `reference_call` here),
            interleaved so that both see the same load. Target: the median sandboxed call at most
            50 ms slower. --sandbox-only runs this case alone (no vLLM, a few seconds).
Both modes end with the same turns per conversation, and every tool output is the code's (checked).
"""

import argparse
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "bench")]  # megarl, and the bench's helpers for the pool's workers

import python_workload  # noqa: E402
from paired_timing import json_stdout  # noqa: E402
from slow_env import QUICK_S, SLOW_S  # noqa: E402

from megarl.rollout.agent.chat_insert import first_prompt_ids, inserted_ids  # noqa: E402
from megarl.rollout.agent.loop import AgentConfig, AgentLoop  # noqa: E402
from megarl.rollout.agent.tools import LOCAL  # noqa: E402
from megarl.rollout.agent.tools import python as python_tool  # noqa: E402
from megarl.rollout.engine import SamplingConfig  # noqa: E402
from megarl.rollout.producer import produce  # noqa: E402
from megarl.rollout.prompts import load_prompts  # noqa: E402
from megarl.rollout.turns import TurnDriver  # noqa: E402

ENV = "slow_env:step"
TARGET_SPEEDUP = 2.0
SANDBOX_TARGET_S = 0.050  # a sandboxed call's cost over the tool before the sandbox
SAMPLING = SamplingConfig(n=1, temperature=1.0, max_new_tokens=64, seed=0)
# The python case's budget: T short answers plus T - 1 inserted tool outputs of a few tokens each,
# so that no conversation ends on its budget before its last turn.
PYTHON_SAMPLING = SamplingConfig(n=1, temperature=1.0, max_new_tokens=160, seed=0)


def _with_extra(prompt, extra_info: dict):
    return type(prompt)(prompt.text, prompt.token_ids, prompt.answer, prompt.data_source, extra_info,
                        prompt.messages)


def _env_workload(prompts, seed: int):
    """The prompts, each with its conversation's turns and slow steps in extra_info."""
    rng = random.Random(seed)
    chosen = []
    for prompt in prompts:
        turns = rng.randint(1, 8)
        slow = [t for t in range(1, turns + 1) if rng.random() < 1 / 8]
        chosen.append(_with_extra(prompt, {"interaction_kwargs": {"turns": turns, "slow_turns": slow}}))
    return chosen


def _lockstep(engine, tokenizer, prompts, pool, sampling, turns, answer, schemas=None) -> list:
    """Turns per conversation, generated a turn at a time for all of them together. After each
    wave, `answer(live indices, their messages)` runs every live conversation's step in the pool
    and returns each one's next message, or None where the conversation ends; a conversation
    also ends at `turns` assistant turns."""
    ids = [first_prompt_ids(tokenizer, p.messages, schemas) for p in prompts]
    response = [[] for _ in prompts]
    messages = [list(p.messages) for p in prompts]
    said = [0] * len(prompts)
    alive = list(range(len(prompts)))
    while alive:
        samples = engine.generate([ids[i] + response[i] for i in alive], sampling)
        for i, sample in zip(alive, samples):
            response[i] += sample.response_ids
            said[i] += 1
            messages[i].append({"role": "assistant", "content": tokenizer.decode(sample.response_ids,
                                                                                 skip_special_tokens=True)})
        alive = [(i, s) for i, s in zip(alive, samples) if said[i] < turns]
        going = []
        for (i, sample), reply in zip(alive, answer([i for i, _ in alive], [messages[i] for i, _ in alive])):
            if reply is None:
                continue
            response[i] += inserted_ids(tokenizer, sample.response_ids, [reply], schemas)
            messages[i].append(reply)
            going.append(i)
        alive = going
    return said


def _pool_values(pool, jobs) -> list:
    replies = pool.map(jobs)
    failed = [reply.error for reply in replies if reply.value is None]
    if failed:
        raise RuntimeError(f"{len(failed)} steps failed, first: {failed[0]}")
    return [reply.value for reply in replies]


def env_case(engine, tokenizer, prompts, seed: int) -> dict:
    prompts = _env_workload(prompts, seed)
    # max_turns above the longest conversation: both modes run every environment step, the last too
    config = AgentConfig(interaction=ENV, max_turns=9, tool_workers=len(prompts), tool_timeout_s=60)
    loop = AgentLoop(tokenizer, config)
    loop.pool().map([(ENV, ("interaction", ([], {"turns": 0, "quick_s": 0.0})))] * len(prompts))
    kwargs = [p.extra_info["interaction_kwargs"] for p in prompts]

    def answer(live, messages):
        jobs = [(ENV, ("interaction", (m, kwargs[i]))) for i, m in zip(live, messages)]
        replies = _pool_values(loop.pool(), jobs)
        return [None if r.get("done") else {"role": "user", "content": r["content"]} for r in replies]

    # The loop's max_new_tokens is a conversation's whole response, inserted steps included; the
    # lockstep run's is each turn's (it generates a turn at a time). A conversation's budget of
    # max_turns such turns binds neither: both end every conversation at its workload's turns
    # (checked below; with 64 in all, one 8-turn conversation ended on its budget at turn 7).
    conversation = replace(SAMPLING, max_new_tokens=config.max_turns * SAMPLING.max_new_tokens)
    start = time.monotonic()
    in_flight = [s.events["turns"] for s in produce(loop, TurnDriver(engine), prompts, conversation)]
    in_flight_s = time.monotonic() - start
    start = time.monotonic()
    lockstep = _lockstep(engine, tokenizer, prompts, loop.pool(), SAMPLING, config.max_turns, answer)
    lockstep_s = time.monotonic() - start
    loop.close()
    expected = [k["turns"] for k in kwargs]
    if in_flight != expected or lockstep != expected:
        raise RuntimeError(f"turns differ from the workload's: {in_flight} / {lockstep} / {expected}")
    speedup = lockstep_s / in_flight_s
    # The environment's own seconds, generation left out: in flight, the slowest conversation's
    # steps; in lockstep, each wave's slowest step, summed over the waves.
    latency = [[SLOW_S if t in k["slow_turns"] else QUICK_S for t in range(1, k["turns"] + 1)]
               for k in kwargs]
    in_flight_floor = max(sum(steps) for steps in latency)
    lockstep_floor = sum(max(steps[k] for steps in latency if len(steps) > k)
                         for k in range(max(map(len, latency))))
    return {
        "case": "slow_env", "conversations": len(prompts), "turns_total": sum(expected),
        "turns_per_conversation": {str(k): expected.count(k) for k in sorted(set(expected))},
        "slow_steps": sum(len(k["slow_turns"]) for k in kwargs),
        "in_flight_s": round(in_flight_s, 2), "lockstep_s": round(lockstep_s, 2),
        "in_flight_floor_s": round(in_flight_floor, 2), "lockstep_floor_s": round(lockstep_floor, 2),
        "speedup": round(speedup, 2), "target_speedup": TARGET_SPEEDUP, "passed": speedup >= TARGET_SPEEDUP}


def _sandbox_seconds(iterations: int) -> float:
    start = time.monotonic()
    python_tool(python_workload.code(iterations))
    return time.monotonic() - start


def python_case(engine, tokenizer, prompts, turns: int, seed: int) -> dict:
    loops = python_workload.draw_iterations(len(prompts), seed)
    codes = [python_workload.code(n) for n in loops]
    prompts = [_with_extra(p, {"tools_kwargs": {"python": {"code": c}}}) for p, c in zip(prompts, codes)]
    config = AgentConfig(tools=("python",), parser="python_workload:every_turn_calls_python", max_turns=turns,
                         tool_workers=len(prompts), tool_timeout_s=60)
    loop = AgentLoop(tokenizer, config)
    _pool_values(loop.pool(), [("python", ("tool", ({"code": "pass"}, LOCAL)))] * len(prompts))  # workers up

    def answer(live, messages):
        outputs = _pool_values(loop.pool(), [("python", ("tool", ({"code": codes[i]}, LOCAL))) for i in live])
        return [{"role": "tool", "name": "python", "content": out} for out in outputs]

    start = time.monotonic()
    samples = produce(loop, TurnDriver(engine), prompts, PYTHON_SAMPLING)
    in_flight_s = time.monotonic() - start
    start = time.monotonic()
    lockstep = _lockstep(engine, tokenizer, prompts, loop.pool(), PYTHON_SAMPLING, turns, answer,
                         loop.schemas)
    lockstep_s = time.monotonic() - start
    loop.close()
    for sample, n in zip(samples, loops):
        outputs = [m["content"] for m in sample.trajectory if m["role"] == "tool"]
        if sample.events["turns"] != turns or outputs != [python_workload.expected_output(n)] * (turns - 1):
            raise RuntimeError(f"a conversation ran {sample.events['turns']} turns of {turns} (finish "
                               f"{sample.finish_reason!r}) with tool outputs {outputs}, expected "
                               f"{python_workload.expected_output(n)!r} each")
    if lockstep != [turns] * len(prompts):
        raise RuntimeError(f"lockstep ran {lockstep} turns, expected {turns} each")
    # Each call's wall seconds alone, the sandbox's start included: the tools' size, not a floor
    # (a start's waiting overlaps other calls' work, and a quiet run beat wall / cores).
    calibration = {n: _sandbox_seconds(n) for n in (min(loops), max(loops))}
    tool_s = sum(_sandbox_seconds(n) for n in loops) * (turns - 1)
    cores = len(os.sched_getaffinity(0))
    return {
        "case": "python", "conversations": len(prompts), "turns_per_conversation": turns,
        "tool_calls": len(prompts) * (turns - 1),
        "loop_iterations_min_max": [min(loops), max(loops)],
        "sandbox_call_s_min_max": [round(calibration[min(loops)], 3), round(calibration[max(loops)], 3)],
        "tool_seconds_serial": round(tool_s, 2), "cores": cores,
        "in_flight_s": round(in_flight_s, 2), "lockstep_s": round(lockstep_s, 2),
        "speedup": round(lockstep_s / in_flight_s, 2)}


def _reference_limits():
    resource.setrlimit(resource.RLIMIT_CPU, (10, 10))
    resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))
    resource.setrlimit(resource.RLIMIT_FSIZE, (16 << 20, 16 << 20))


def reference_call(code: str) -> str:
    """The python tool before issue 54 (at 22f0b7a): a network namespace of its own and rlimits,
    in a temporary folder, nothing else isolated."""
    with tempfile.TemporaryDirectory() as workdir:
        proc = subprocess.run(["unshare", "-rn", sys.executable, "-I", "-c", code], cwd=workdir,
                              env={"PATH": os.defpath, "HOME": workdir}, stdin=subprocess.DEVNULL,
                              capture_output=True, preexec_fn=_reference_limits, timeout=30)
    return (proc.stdout + proc.stderr).decode(errors="replace")


def sandbox_case(calls: int) -> dict:
    """Seconds per call of each tool, on `print(1)`: a call's cost is its interpreter's start and
    its isolation, nothing else."""
    seconds = {"sandboxed": [], "before": []}
    tools = {"sandboxed": python_tool, "before": reference_call}
    for name, tool in tools.items():  # warm: the sandbox finds the interpreter's files once
        if tool("print(1)") != "1\n":
            raise RuntimeError(f"the {name} tool printed {tool('print(1)')!r}, not '1\\n'")
    for _ in range(calls):
        for name, tool in tools.items():
            start = time.perf_counter()
            tool("print(1)")
            seconds[name].append(time.perf_counter() - start)
    median = {name: statistics.median(s) for name, s in seconds.items()}
    extra = median["sandboxed"] - median["before"]
    return {"case": "sandbox_call", "calls": calls,
            "sandboxed_median_ms": round(median["sandboxed"] * 1e3, 1),
            "before_median_ms": round(median["before"] * 1e3, 1),
            "sandboxed_p90_ms": round(statistics.quantiles(seconds["sandboxed"], n=10)[-1] * 1e3, 1),
            "before_p90_ms": round(statistics.quantiles(seconds["before"], n=10)[-1] * 1e3, 1),
            "extra_ms": round(extra * 1e3, 1), "target_extra_ms": SANDBOX_TARGET_S * 1e3,
            "passed": extra <= SANDBOX_TARGET_S}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="(the same workload: it takes ~2 min)")
    parser.add_argument("--conversations", type=int, default=64, help="the slow_env case's")
    parser.add_argument("--python-conversations", type=int, default=32)
    parser.add_argument("--python-turns", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sandbox-calls", type=int, default=30, help="the sandbox_call case's")
    parser.add_argument("--sandbox-only", action="store_true", help="run the sandbox_call case alone")
    parser.add_argument("--inputs", help="prepare_demo.py's --out folder to use, with at least as many "
                                         "prompts as conversations (default: made in a temporary folder)")
    args = parser.parse_args()
    out = json_stdout()
    out.write(json.dumps(sandbox_case(args.sandbox_calls)) + "\n")
    if args.sandbox_only:
        return
    import transformers

    from megarl.rollout.vllm.engine import VLLMEngine

    count = max(args.conversations, args.python_conversations)
    # The demo's tokenizer is trained on the prompts: a few would leave it too small to train.
    made = max(count, 64)
    with tempfile.TemporaryDirectory() as made_here:
        inputs = args.inputs or made_here
        if not args.inputs:
            # 8 warm-start steps (the default is 150, for the held-out accuracy): any answers will do here
            subprocess.run([sys.executable, "scripts/prepare_demo.py", "--out", inputs, "--hf-only",
                            "--prompts", str(made), "--sft-steps", "8"], cwd=ROOT, check=True,
                           stdout=sys.stderr)
        model = os.path.join(inputs, "model")
        tokenizer = transformers.AutoTokenizer.from_pretrained(model)
        prompts = load_prompts(os.path.join(inputs, "train.jsonl"), tokenizer, 64).prompts[:count]
        engine = VLLMEngine(model, load_format="auto", dtype="float32", max_model_len=256)
        engine.generate([p.token_ids for p in prompts], SAMPLING)  # warm-up
        env = env_case(engine, tokenizer, prompts[:args.conversations], args.seed)
        out.write(json.dumps(env) + "\n")
        tools = python_case(engine, tokenizer, prompts[:args.python_conversations], args.python_turns,
                            args.seed)
        out.write(json.dumps(tools) + "\n")


if __name__ == "__main__":
    main()
