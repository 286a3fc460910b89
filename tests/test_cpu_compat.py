"""The Megatron-Core CPU shims are scoped: Megatron's modules see a CPU `torch.cuda`, every
other module (vLLM included) sees the real one."""

import sys

import pytest
import torch

from megarl.platform import cpu_compat

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="shims are off with CUDA")


def test_megatron_modules_see_cpu_cuda_and_others_do_not():
    cpu_compat.install()
    mappings = sys.modules["megatron.core.tensor_parallel.mappings"]
    assert mappings.torch.cuda.current_device() == torch.device("cpu")
    assert mappings.torch.zeros(2, device="cuda").device.type == "cpu"
    assert mappings.torch.Tensor is torch.Tensor
    assert torch.cuda.is_available() is False
    with pytest.raises((AssertionError, RuntimeError)):
        torch.cuda.current_device()
    with pytest.raises((AssertionError, RuntimeError)):
        torch.zeros(2, device="cuda")


def test_tensor_cuda_is_identity_only_inside_wrapped_calls():
    seen = []
    wrapped = cpu_compat._keep_on_cpu(lambda t: seen.append(t.cuda()))
    t = torch.ones(2)
    wrapped(t)
    assert seen[0] is t
    with pytest.raises((AssertionError, RuntimeError)):
        t.cuda()


def test_rng_tracker_forks_independent_streams():
    tracker = cpu_compat.CpuRNGStatesTracker()
    tracker.add("model-parallel-rng", 7)
    torch.manual_seed(0)
    outer = torch.get_rng_state()
    with tracker.fork():
        first = torch.rand(3)
    assert torch.equal(torch.get_rng_state(), outer)  # the default stream is untouched
    with tracker.fork():
        second = torch.rand(3)
    assert not torch.equal(first, second)  # the forked stream advanced
    assert torch.equal(first, torch.rand(3, generator=torch.Generator().manual_seed(7)))
