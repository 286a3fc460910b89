"""Rollout engines on ranks of their own (layout.rollout_world_size) under torchrun, with real
vLLM: staleness 0 is exactly the synchronous colocated loop; with staleness 1 and 2 no trained
sample is older than the bound, and every token sampled by the weights the trainer holds gets
its log-prob back exactly from the trainer (fp32), also in responses continued across a sync; an
engine killed with kill -9 is replaced and the run finishes.

The model is the demo's task on a Qwen2-style model warm-started for only 1 step: its responses
run 1-96 tokens (mean ~30-40 at temperature 1), so generation spans training steps and syncs
(whether a sync finds requests in flight depends on timing here: tests/test_streaming_rollout.py
interrupts requests at a chosen point and checks every token against HF transformers)."""

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from tests.launch import ROOT, run

SCRIPT = "scripts/train_ppo_moe.py"


@pytest.fixture(scope="module")
def tail_inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tail_inputs")
    run("scripts/prepare_demo.py", "--out", str(root), "--prompts", "200", "--model", "qwen2",
        "--sft-steps", "1", "--hf-only")  # the runs load the HF checkpoint (model.megatron_dir=null)
    return root


def _args(inputs, run_dir, *extra):
    return ("--config", "configs/demo_cpu.yaml", f"model.hf_dir={inputs / 'model'}",
            "model.megatron_dir=null", f"data.path={inputs / 'train.jsonl'}", f"run_dir={run_dir}",
            "layout.world_size=1", "layout.ep=1", 'actor.router_replay="off"',
            "actor.rollout_correction.preset=decoupled_token_is", "data.prompts_per_step=8",
            "generation.max_new_tokens=96", "checkpoint.every=0", "checkpoint.export_hf=false", *extra)


def _steps(run_dir):
    with open(run_dir / "metrics.jsonl") as f:
        return [json.loads(line) for line in f]


def _computed(step):
    """What the run computed, without what the machine measured or the placement adds."""
    return {k: v for k, v in step.items()
            if not k.startswith(("time/", "throughput/", "memory/", "async/"))}


def test_staleness_zero_on_rollout_ranks_is_the_synchronous_loop(tail_inputs, tmp_path):
    colocated, disaggregated = tmp_path / "colocated", tmp_path / "disaggregated"
    one_rank = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": "29541", "OMP_NUM_THREADS": "1"}  # as torchrun sets it
    # The two runs at once: most of a 2-step run is start-up, and either one alone leaves a core idle.
    command = [sys.executable, os.path.join(ROOT, SCRIPT), *_args(tail_inputs, colocated, "steps=2")]
    reference = subprocess.Popen(command, cwd=ROOT, env={**os.environ, **one_rank}, stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, text=True)
    run(SCRIPT, *_args(tail_inputs, disaggregated, "steps=2", "layout.rollout_world_size=1",
                       "async.max_staleness=0"), nproc=2, timeout=900)
    output, _ = reference.communicate(timeout=900)
    assert reference.returncode == 0, output[-4000:]
    sync, async_ = _steps(colocated), _steps(disaggregated)
    assert len(sync) == len(async_) == 2
    for s, a in zip(sync, async_):
        assert _computed(a) == _computed(s)
        assert a["async/version_lag_max"] == 0 and a["async/sample_lag_max"] == 0
        assert a["async/trainer_version"] == a["step"] - 1
        assert a["async/mismatch_lag0_max"] < 1e-4
    assert sync[0]["response/length_mean"] > 10  # the workload has long responses


def _check_bounds(steps, staleness: int) -> None:
    for s in steps:
        # Every sample (its oldest token) and every token is within the bound.
        assert s["async/sample_lag_max"] <= staleness and s["async/version_lag_max"] <= staleness
        # Tokens sampled by the trainer's own weights: the trainer's recomputed log-probs are
        # vLLM's, also after a prefix sampled by older weights (recomputed at the resubmission).
        if "async/mismatch_lag0_max" in s:
            assert s["async/mismatch_lag0_max"] < 1e-4
    assert max(s["async/version_lag_max"] for s in steps) >= 1  # it did run ahead


# GRPO without a critic: training is faster than generation, as on a GPU cluster.
FAST_TRAINER = ("algo.advantage=grpo", "algo.kl_reward_coeff=0")


def _torchrun(inputs, run_dir, *extra) -> subprocess.Popen:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
               os.path.join(ROOT, SCRIPT),
               *_args(inputs, run_dir, "layout.rollout_world_size=1", *FAST_TRAINER, *extra)]
    return subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@pytest.fixture(scope="module")
def staleness_runs(tail_inputs, tmp_path_factory):
    """Two runs started together (most of a run is start-up; one alone leaves a core idle):
    staleness 1 with partial rollouts continued, whose engine is killed with kill -9 once step 2
    is logged; staleness 2 with partial rollouts restarted. {name: (run dir, output, return code)}
    and the killed engine's pid."""
    root = tmp_path_factory.mktemp("staleness_runs")
    killed, restarted = root / "killed", root / "restarted"
    first = _torchrun(tail_inputs, killed, "steps=6", "async.max_staleness=1")
    second = _torchrun(tail_inputs, restarted, "steps=4", "async.max_staleness=2",
                       "async.partial_rollout=restart")
    deadline = time.time() + 600
    while not (killed / "metrics.jsonl").exists() or len(_steps(killed)) < 2:
        assert first.poll() is None and time.time() < deadline, "the run ended before step 2"
        time.sleep(0.2)
    (engine,) = re.findall(r"rollout engine process (\d+) \(generation 0\) started",
                           (killed / "logs" / "rank1.log").read_text())
    os.kill(int(engine), signal.SIGKILL)
    done = {name: (run_dir, *proc.communicate(timeout=600)[:1], proc.returncode)
            for name, run_dir, proc in (("killed", killed, first), ("restarted", restarted, second))}
    return done, engine


def test_a_killed_rollout_engine_is_replaced_and_the_run_finishes(staleness_runs):
    """kill -9 of the engine process once step 2 is logged: its supervisor starts a new one, the
    trainer pushes it the current weights, the lost steps are generated again, and the run ends
    normally with the replacement counted (staleness 1, partial rollouts continued)."""
    runs, engine = staleness_runs
    run_dir, output, code = runs["killed"]
    assert code == 0, output[-4000:]
    steps = _steps(run_dir)
    assert [s["step"] for s in steps] == list(range(1, 7))
    assert steps[-1]["async/engine_restarts"] == 1 and steps[0]["async/engine_restarts"] == 0
    assert f"rollout engine process {engine} (generation 0) died (exit code -9)" in output
    _check_bounds(steps, 1)
    # The replacement got the current weights: after it, tokens of the trainer's own version
    # still get their log-probs back exactly (checked in _check_bounds) and some exist.
    assert any("async/mismatch_lag0_max" in s for s in steps[2:])


def test_restarted_partial_rollouts_stay_within_staleness_two(staleness_runs):
    run_dir, output, code = staleness_runs[0]["restarted"]
    assert code == 0, output[-4000:]
    steps = _steps(run_dir)
    assert [s["step"] for s in steps] == [1, 2, 3, 4]
    _check_bounds(steps, 2)
    assert all(s["async/mixed_version_samples"] == 0 for s in steps)  # one version per response
