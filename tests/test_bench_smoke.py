"""Every benchmark `make bench` runs, at its smallest size, started as a user starts it: a bench
that no longer runs, or whose own checks fail, fails here (issue 33: `make bench` broke and
nothing saw it). Each test reads the bench's JSON lines and checks what they must say whatever
the machine's load: the cases are there, the work was done and checked. The sizes are chosen for
time, not for figures, so targets and ratios are not asserted (docs/PERFORMANCE.md has them); for
the same reason the benches that run in one process run side by side (ONE_PROCESS)."""

import concurrent.futures
import json
import re

import pytest

from tests.launch import ROOT, run, start


def _lines_of(proc) -> list:
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert lines, f"no JSON line on stdout:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    return lines


def _json_lines(*args, timeout: int = 600, check: bool = True) -> list:
    return _lines_of(run(*args, timeout=timeout, check=check))


def _by_case(lines: list, key: str = "case") -> dict:
    return {line[key]: line for line in lines}


SMOKED = {"bench_sync", "bench_sync_plan", "bench_sync_copies", "bench_rollout", "bench_train", "bench_step",
          "bench_async", "bench_rewards", "bench_agent", "bench_memory"}
# The benches that run in one process (no torchrun) at these sizes: launched together when the first
# of their tests runs, as each alone would leave one of the 2 cores idle most of its time. test ->
# (script, its arguments; INPUTS: a folder of its own, DEMO: the session's demo inputs).
INPUTS, DEMO = "{inputs}", "{demo_inputs}"
ONE_PROCESS = {
    "test_bench_sync_plan": ("bench/bench_sync_plan.py", "--quick", "--repeats", "3"),
    "test_bench_sync_copies": ("bench/bench_sync_copies.py", "--quick", "--experts", "8"),
    "test_bench_rollout": ("bench/bench_rollout.py", "--smoke", "--inputs", INPUTS),
    "test_bench_train": ("bench/bench_train.py", "--quick", "--hidden", "128", "--layers", "1", "--vocab",
                         "512", "--seq-len", "64", "--sequences", "4", "--repeats", "1", "--inputs", INPUTS),
    "test_bench_rewards": ("bench/bench_rewards.py", "--samples", "16", "--workers", "4", "--timeout-s", "1",
                           "--math-samples", "32", "--math-workers", "2"),
    "test_bench_agent": ("bench/bench_agent.py", "--conversations", "4", "--python-conversations", "4",
                         "--python-turns", "2", "--inputs", DEMO),
    # --no-phases: its plan-vs-measured case is tests/test_memory_plan.py's
    "test_bench_memory": ("bench/bench_memory.py", "--tokens", "512", "--vocab", "2048", "--dtype", "float32",
                          "--no-phases"),
}


@pytest.fixture(scope="module")
def one_process(request, tmp_path_factory):
    """one_process(test): the JSON lines of its ONE_PROCESS bench. The selected tests' benches are
    launched at once; a bench that fails fails only its own test."""
    selected = [item.name for item in request.session.items
                if item.module is request.module and item.name in ONE_PROCESS]

    def argument(name, arg):
        if arg == DEMO:
            return str(request.getfixturevalue("demo_inputs"))
        return str(tmp_path_factory.mktemp(name)) if arg == INPUTS else arg

    started = {name: start(*(argument(name, arg) for arg in ONE_PROCESS[name]), timeout=900)
               for name in selected}
    concurrent.futures.wait(started.values())
    return lambda name: _lines_of(started[name].result())


def test_every_bench_make_bench_runs_is_smoked_here():
    with open(f"{ROOT}/Makefile") as f:
        target = f.read().split("\nbench:", 1)[1].split("\n\n", 1)[0]
    assert set(re.findall(r"bench/(bench_\w+)\.py", target)) == SMOKED


# The bench_sync cases smoked here, both on the smallest model at 2 ranks: run by one launch, which
# makes the model's random checkpoint once (~4 s of a core) for both.
SYNC_CASES = {"test_bench_sync": "qwen3-20m-float32-w2-tp2-rtp2",  # the log-prob check on
              "test_bench_sync_lora": "qwen3-20m-float32-w2-tp2-lora16-rtp2"}


@pytest.fixture(scope="module")
def bench_sync(request, tmp_path_factory):
    """({case: its JSON line}, the summary line) of one bench_sync.py launch running the selected
    tests' SYNC_CASES in turn (each case is a torchrun of its own: a failed case fails its test)."""
    cases = [SYNC_CASES[item.name] for item in request.session.items
             if item.module is request.module and item.name in SYNC_CASES]
    *results, summary = _json_lines("bench/bench_sync.py", "--quick", "--only", *cases, "--repeats", "1",
                                    "--out", str(tmp_path_factory.mktemp("bench_sync")), check=False)
    assert summary.get("summary") and summary["cases"] == len(cases), summary
    return _by_case(results), summary


def test_bench_sync(bench_sync):
    case, (results, summary) = SYNC_CASES["test_bench_sync"], bench_sync
    result = results[case]
    assert "error" not in result, result
    assert result["sync_seconds"] > 0 and result["naive_seconds"] > 0, result
    # The actor was perturbed after the first sync: only the second, on the first's plan, matches.
    assert result["plans_built"] == 1 and result["max_abs_logprob_diff"] <= 1e-4, result
    assert case not in summary["failed"], summary


def test_bench_sync_lora(bench_sync):
    """The LoRA case: after the base is written, the adapters alone into vLLM's slots, against the
    full merged sync: each rank takes in the adapters' bytes (a few % of its shard's) and the
    engine then matches the adapted actor."""
    case, (results, summary) = SYNC_CASES["test_bench_sync_lora"], bench_sync
    result = results[case]
    assert "error" not in result and result["slots"], result
    assert result["adapter_bytes_per_rank"] == result["adapter_bytes"] > 0, result
    assert result["full_bytes_per_rank"] == result["model_bytes"] // 2, result  # TP2: half each
    assert result["bytes_ratio"] < 0.05 and result["adapter_sync_seconds"] > 0, result
    assert result["max_abs_logprob_diff"] <= 1e-4, result
    assert case not in summary["failed"] and case in summary["lora_adapter_sync"], summary


def test_bench_sync_plan(one_process):
    (result,) = one_process("test_bench_sync_plan")
    assert result["plans_built"] == 1 and result["reused_same_plan"], result  # built once, then found
    assert result["first_build_s"] > 0 and result["reuse_s"] > 0 and result["planned_sync_s"] > 0, result
    assert result["rank_copies"] > 0 and result["buckets"] > 1, result


def test_bench_sync_copies(one_process):
    (result,) = one_process("test_bench_sync_copies")
    assert result["copies"] == 2 * 8, result  # a gate and an up slab per expert
    for key in ("batched_us_per_copy", "one_copy_each_us_per_copy", "views_only_us_per_copy"):
        assert result[key] > 0, result


def test_bench_rollout(one_process):
    cases = _by_case(one_process("test_bench_rollout"))
    assert set(cases) == {"rollout_generate_vs_bare", "rollout_collect_vs_bare"}
    for result in cases.values():
        assert result["same_tokens"] and result["tokens_generated"] > 0, result
        assert 0 <= result["own_share"] < 1 and result["bare_seconds"] > 0, result


def test_bench_train(one_process):
    cases = _by_case(one_process("test_bench_train"))
    assert set(cases) == {"actor_update_vs_bare", "packed_vs_padded", "lora_vs_full"}
    assert cases["actor_update_vs_bare"]["tokens"] > 0
    packed = cases["packed_vs_padded"]
    assert 0 < packed["useful_tokens"] < packed["padded_tokens"], packed  # lengths are spread
    assert packed["packed_seconds"] > 0 and packed["padded_seconds"] > 0, packed
    adapted = cases["lora_vs_full"]  # rank 16 on a 128-wide model: the adapters are no small share
    assert 0 < adapted["lora_optimizer_state_bytes"] < adapted["full_optimizer_state_bytes"], adapted


def test_bench_step(demo_inputs, tmp_path):
    (result,) = _json_lines("bench/bench_step.py", "--steps", "2", "--inputs", str(demo_inputs),
                            "--run-dir", str(tmp_path / "run"), timeout=900)
    assert result["steps_measured"] == 1, result  # the first step (vLLM's warm-up) is left out
    assert {"generate", "sync"} <= set(result["phase_seconds"]), result
    assert 0 < result["sync_share"] < 1 and result["tokens_per_s"] > 0, result


def test_bench_async(demo_inputs, tmp_path):
    (result,) = _json_lines("bench/bench_async.py", "--steps", "2", "--prompts-per-step", "2",
                            "--max-new-tokens", "16", "--inputs", str(demo_inputs), "--out", str(tmp_path),
                            timeout=900)
    for placement in ("sync", "async"):
        assert result[placement]["steps_measured"] == 1 and result[placement]["tokens_per_s"] > 0, result
    assert result["async"]["rollout_generate_s"] > 0, result  # the rollout rank generated
    assert result["speedup"] > 0, result


def test_bench_rewards(one_process):
    cases = _by_case(one_process("test_bench_rewards"))
    sleep, math = cases["sleep"], cases["math"]
    # Sleeping functions overlap in the pool whatever the load: 4 workers on 0.2 s sleeps.
    assert sleep["speedup"] > 2, sleep
    assert sleep["hang_timeouts"] == 1 and sleep["hang_rewards"] == [0.0] + [1.0] * 7, sleep
    assert math["scored_right"] == math["answers_right"] == 16, math  # half the answers are right
    assert math["speedup_ceiling"] == min(2, math["cores"]) and math["pooled_s"] > 0, math


def test_bench_agent(one_process):
    cases = _by_case(one_process("test_bench_agent"))
    env, tools = cases["slow_env"], cases["python"]
    assert env["conversations"] == 4 and env["turns_total"] >= 4, env
    # Neither mode can beat the environment's own seconds.
    assert env["in_flight_s"] >= env["in_flight_floor_s"], env
    assert env["lockstep_s"] >= env["lockstep_floor_s"], env
    assert tools["tool_calls"] == 4 and tools["tool_seconds_serial"] > 0, tools
    assert tools["in_flight_s"] > 0 and tools["lockstep_s"] > 0, tools


def test_bench_memory(one_process):
    lines = one_process("test_bench_memory")
    cases = _by_case(lines)
    assert "full" in cases and "skipped" not in cases["full"], cases
    heads = _by_case([line for line in lines if line["case"] == "head"], "kernels")
    assert set(heads) == {"eager", "compiled"}, lines
    # each kernel computes what the full-width path does, gradients included
    compared = _by_case([line for line in lines if line["case"] == "head_vs_full"], "kernels")
    assert set(compared) == {"eager", "compiled"}, lines
    for kernels, line in compared.items():
        diffs = {k: v for k, v in line.items() if k.startswith("max_abs_diff_")}
        assert len(diffs) == 3 and max(diffs.values()) <= 1e-5, (kernels, diffs)
