"""GPU or CPU, never by a silent fallback (megarl/platform/device_choice.py): the choice for
every combination of MEGARL_DEVICE and what the machine has, and this machine's own choice.
(Transformer Engine's choice: tests/test_transformer_engine_choice.py.)"""

import pytest

from megarl.platform import device_choice
from megarl.platform.device_choice import choose

GPU = dict(cuda_available=True, gpu_present=True, nccl_available=True, torch_version="2.13.0+cu130")
CPU_BOX = dict(cuda_available=False, gpu_present=False, nccl_available=False, torch_version="2.13.0+cpu")
CPU_TORCH_ON_GPU_NODE = {**CPU_BOX, "gpu_present": True}


@pytest.mark.parametrize("requested,machine,on_gpu", [
    (None, GPU, True), ("", GPU, True), ("cuda", GPU, True), (" CUDA ", GPU, True),
    ("cpu", GPU, False),  # asked for: the CPU path even where a GPU works
    (None, CPU_BOX, False), ("cpu", CPU_BOX, False),
    ("cpu", CPU_TORCH_ON_GPU_NODE, False),
])
def test_the_choice(requested, machine, on_gpu):
    assert choose(requested, **machine) is on_gpu


@pytest.mark.parametrize("requested,machine,message", [
    ("cuda", CPU_BOX, r"MEGARL_DEVICE=cuda but torch 2.13.0\+cpu cannot use CUDA \(a CPU build\) and this "
                      r"machine shows no NVIDIA device: install the GPU build .*or set MEGARL_DEVICE=cpu"),
    ("cuda", CPU_TORCH_ON_GPU_NODE, r"MEGARL_DEVICE=cuda but torch 2.13.0\+cpu cannot use CUDA \(a CPU "
                                    r"build\): install the GPU build with `make install DEVICE=cuda` "
                                    r"\(its own environment, .venv-cuda\)"),
    # the silent fallback this module exists to stop: a GPU node with a CPU build of torch
    (None, CPU_TORCH_ON_GPU_NODE, r"this machine has an NVIDIA GPU but torch 2.13.0\+cpu cannot use it "
                                  r"\(a CPU build\).*or set MEGARL_DEVICE=cpu to run on the CPU on purpose"),
    (None, {**CPU_TORCH_ON_GPU_NODE, "torch_version": "2.13.0+cu130"},
     r"NVIDIA GPU but torch 2.13.0\+cu130 cannot use it: install"),  # a broken driver
    ("cuda", {**GPU, "nccl_available": False},
     r"a GPU is in use but NCCL is missing: install the GPU build .*or set MEGARL_DEVICE=cpu"),
    ("gpu", GPU, r"MEGARL_DEVICE='gpu': use one of cuda, cpu, or leave it unset"),
    ("gpu", CPU_BOX, r"MEGARL_DEVICE='gpu'"),  # a typo is refused even where it would not matter
])
def test_what_is_missing_is_named_with_the_fix(requested, machine, message):
    with pytest.raises(RuntimeError, match=message):
        choose(requested, **machine)


@pytest.fixture
def fresh_choice(monkeypatch):
    caches = (device_choice.on_gpu, device_choice.uses_transformer_engine, device_choice._this_te_error)
    for cache in caches:
        cache.cache_clear()
    yield monkeypatch
    for cache in caches:
        cache.cache_clear()


def test_this_cpu_machine_chooses_the_cpu_and_refuses_cuda(fresh_choice):
    fresh_choice.delenv("MEGARL_DEVICE", raising=False)
    assert device_choice.on_gpu() is False
    device_choice.on_gpu.cache_clear()
    fresh_choice.setenv("MEGARL_DEVICE", "cuda")
    with pytest.raises(RuntimeError, match="MEGARL_DEVICE=cuda but torch .* cannot use CUDA"):
        device_choice.on_gpu()


def test_this_cpu_machine_builds_without_transformer_engine_and_refuses_it(fresh_choice):
    fresh_choice.delenv("MEGARL_DEVICE", raising=False)
    for setting in (None, "auto", "false"):
        if setting is None:
            fresh_choice.delenv("MEGARL_TRANSFORMER_ENGINE", raising=False)
        else:
            fresh_choice.setenv("MEGARL_TRANSFORMER_ENGINE", setting)
        device_choice.uses_transformer_engine.cache_clear()
        assert device_choice.uses_transformer_engine() is False
        choice = device_choice.this_choice(3)
        assert (choice.use_te, choice.spec) == (False, "the portable layer spec (the CPU path)")
        assert choice.te_off is None  # the CPU path says nothing new
    fresh_choice.setenv("MEGARL_TRANSFORMER_ENGINE", "true")
    device_choice.uses_transformer_engine.cache_clear()
    with pytest.raises(RuntimeError, match="MEGARL_TRANSFORMER_ENGINE=true .*takes the CPU path"):
        device_choice.uses_transformer_engine()
