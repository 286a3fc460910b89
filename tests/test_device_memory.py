"""Measured memory on CPU against the kernel's own counts (/proc/self/status), and nested
windows: a measured block inside a step keeps the step's peak."""

import torch

from megarl.parallel_state import device_memory

MIB = 2**20


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        line = next(line for line in f if line.startswith(field + ":"))
    return int(line.split()[1]) * 1024  # kB


def test_peak_is_the_peak_resident_set_and_resets():
    before = _status("VmRSS")
    block = torch.ones(64 * MIB)  # 256 MiB, touched
    assert device_memory.peak_bytes() >= before + 256 * MIB * 0.9
    assert abs(device_memory.peak_bytes() - _status("VmHWM")) <= 0.01 * _status("VmHWM")
    del block
    device_memory.reset_peak()
    assert device_memory.peak_bytes() < before + 128 * MIB  # the freed block no longer counts


def test_a_measured_block_reports_its_own_peak_and_keeps_the_outer_one():
    device_memory.reset_peak()
    step = torch.ones(48 * MIB)  # 192 MiB held by the "step" before the block
    del step  # freed, but part of the step's peak
    with device_memory.measured() as inner:
        held = [torch.ones(16 * MIB) for _ in range(2)]  # 128 MiB at once inside
        del held
        transient = torch.ones(8 * MIB)  # 32 MiB, after the larger peak
        del transient
    assert 120 * MIB <= inner.extra_bytes <= 160 * MIB, inner.extra_bytes / MIB
    # The step's window still sees its own earlier, larger peak.
    assert device_memory.peak_bytes() >= _status("VmRSS") + 150 * MIB
