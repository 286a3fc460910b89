"""The sbatch scripts on a real one-node Slurm (tests/slurm_cluster.py): the conversion job
round-trips the demo model bit for bit, and the training job starts Ray under srun, trains two
steps from the converted checkpoint and writes its metrics; a failing trainer fails the job.
No job may leave a Ray process behind."""

import json
import os
import subprocess
import sys

import pytest

from tests import slurm_cluster
from tests.launch import ROOT, ray_pids, run

# Set by CI (.ci/run), which runs as root on Debian: there Slurm must run, so a missing one fails
# these tests instead of skipping them unseen among the run's other skips.
REQUIRE = "MEGARL_REQUIRE_SLURM"


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    reason = slurm_cluster.unavailable_reason()
    if reason and os.environ.get(REQUIRE) == "1":
        pytest.fail(f"no real Slurm, and {REQUIRE}=1 requires one: {reason}")
    if reason:
        pytest.skip(f"no real Slurm: {reason} (set {REQUIRE}=1 to fail instead)")
    with slurm_cluster.local_slurm(str(tmp_path_factory.mktemp("slurm"))) as env:
        yield {**env, "MEGARL_PYTHON": sys.executable}



def _sbatch(env, log, script, *args, timeout=900):
    """Submit, wait for the job to end; its exit code and its whole output (sbatch's and the job's)."""
    before = ray_pids()
    proc = subprocess.run(["sbatch", "--wait", f"--output={log}", script, *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)
    output = open(log).read() if os.path.exists(log) else ""
    # However the job ended, it must not leave Ray daemons or workers behind.
    assert ray_pids() <= before, f"Ray processes left by the job: {ray_pids() - before}\n{output[-3000:]}"
    return proc.returncode, f"{proc.stdout}{proc.stderr}\n--- job output ---\n{output}"


def test_conversion_and_training_jobs(slurm, demo_inputs, tmp_path):
    megatron, back = tmp_path / "megatron", tmp_path / "hf_again"
    rc, out = _sbatch(slurm, tmp_path / "to_megatron.out", "scripts/slurm/convert.sbatch",
                      "hf-to-megatron", "--hf-dir", str(demo_inputs / "model"), "--out", str(megatron))
    assert rc == 0, out[-6000:]
    rc, out = _sbatch(slurm, tmp_path / "to_hf.out", "scripts/slurm/convert.sbatch",
                      "megatron-to-hf", "--megatron-dir", str(megatron), "--out", str(back))
    assert rc == 0, out[-6000:]
    run("scripts/compare_hf_checkpoints.py", str(demo_inputs / "model"), str(back))

    run_dir = tmp_path / "run"
    rc, out = _sbatch(slurm, tmp_path / "train.out", "scripts/slurm/train_ppo_moe.sbatch",
                      "--config", "configs/demo_cpu.yaml", f"model.hf_dir={demo_inputs / 'model'}",
                      f"model.megatron_dir={megatron}", f"data.path={demo_inputs / 'train.jsonl'}",
                      f"run_dir={run_dir}", "steps=2",
                      # read here: the metrics alone (the final checkpoint and export: tests/test_loop.py)
                      "checkpoint.every=0", "checkpoint.export_hf=false")
    assert rc == 0, out[-6000:]
    assert "all 1 node(s) joined Ray" in out, out[-6000:]
    with open(run_dir / "metrics.jsonl") as f:
        steps = [json.loads(line) for line in f]
    assert [s["step"] for s in steps] == [1, 2]
    assert all(0.0 <= s["reward/mean"] <= 1.0 and s["mismatch/logprob_diff_max"] < 1e-4 for s in steps)


def test_a_failing_trainer_fails_the_job_and_stops_ray(slurm, demo_inputs, tmp_path):
    rc, out = _sbatch(slurm, tmp_path / "bad.out", "scripts/slurm/train_ppo_moe.sbatch",
                      "--config", "configs/demo_cpu.yaml", f"model.hf_dir={demo_inputs / 'model'}",
                      f"data.path={demo_inputs / 'missing.jsonl'}", f"run_dir={tmp_path / 'run'}")
    assert rc != 0, out[-6000:]
    assert "data.path=" in out and "missing.jsonl' does not exist" in out, out[-6000:]
