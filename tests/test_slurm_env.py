"""scripts/slurm/env.sh, which both sbatch scripts source: the device, the environment's Python,
the container options, and what it says about forwarded NCCL settings. Sourced by bash with a
made-up checkout; the sbatch scripts themselves run on a real Slurm in tests/test_slurm.py."""

import os
import subprocess

import pytest

from tests.launch import ROOT

ENV_SH = os.path.join(ROOT, "scripts", "slurm", "env.sh")
CLEAN = {"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", "/root")}


def _source(checkout, **env):
    script = (f'set -euo pipefail; root={checkout}; source {ENV_SH}; '
              'echo "device=${MEGARL_DEVICE:-}"; echo "python=$python"; '
              'echo "pythonpath=${PYTHONPATH:-}"; printf "on_node=%s\\n" "${on_node[@]}"')
    proc = subprocess.run(["bash", "-c", script], env={**CLEAN, **env}, capture_output=True, text=True)
    lines = [line.split("=", 1) for line in proc.stdout.splitlines()]
    out = {}
    for key, value in lines:
        out.setdefault(key, []).append(value)
    return proc.returncode, {k: v if k == "on_node" else v[0] for k, v in out.items()}, proc.stderr


@pytest.fixture
def checkout(tmp_path):
    for venv in (".venv", ".venv-cuda"):
        python = tmp_path / venv / "bin" / "python"
        python.parent.mkdir(parents=True)
        python.write_text("#!/bin/sh\n")
        python.chmod(0o755)
    return tmp_path


def test_cpu_allocation_uses_the_cpu_environment(checkout):
    rc, out, _ = _source(checkout)
    assert rc == 0 and out["device"] == "" and out["python"] == f"{checkout}/.venv/bin/python"
    assert out.get("on_node", [""]) == [""]


def test_gpu_allocation_asks_for_cuda_and_its_environment(checkout):
    rc, out, _ = _source(checkout, SLURM_GPUS_ON_NODE="8")
    assert rc == 0 and out["device"] == "cuda" and out["python"] == f"{checkout}/.venv-cuda/bin/python"
    # an explicit choice stands
    rc, out, _ = _source(checkout, SLURM_GPUS_ON_NODE="8", MEGARL_DEVICE="cpu")
    assert rc == 0 and out["device"] == "cpu" and out["python"] == f"{checkout}/.venv/bin/python"


def test_missing_gpu_environment_names_the_install(checkout):
    (checkout / ".venv-cuda" / "bin" / "python").unlink()
    rc, _, err = _source(checkout, SLURM_JOB_GPUS="0,1")
    assert rc == 2 and f"{checkout}/.venv-cuda/bin/python is not an executable Python; run " \
        f"'make install DEVICE=cuda' in {checkout}" in err


def test_container_image_runs_steps_in_it_with_the_checkout_mounted(checkout):
    rc, out, _ = _source(checkout, SLURM_GPUS_ON_NODE="8", MEGARL_CONTAINER_IMAGE="/images/megarl.sqsh",
                         MEGARL_CONTAINER_MOUNTS="/data:/data", PYTHONPATH="/extra")
    assert rc == 0 and out["python"] == "/opt/megarl/venv/bin/python"
    assert out["on_node"] == ["--container-image=/images/megarl.sqsh", f"--container-workdir={checkout}",
                              f"--container-mounts={checkout}:{checkout},/data:/data"]
    assert out["pythonpath"] == f"{checkout}:/extra"


def test_forwarded_network_settings_are_listed(checkout):
    rc, _, err = _source(checkout, NCCL_IB_HCA="mlx5_0", UCX_NET_DEVICES="mlx5_0:1", OTHER="x")
    assert rc == 0
    assert sorted(err.splitlines()) == ["megarl: forwarding NCCL_IB_HCA=mlx5_0",
                                        "megarl: forwarding UCX_NET_DEVICES=mlx5_0:1"]
