"""Measured memory on CPU against the kernel's own counts (/proc/self/status), and nested
windows: a measured block inside a step keeps the step's peak. Memory is taken as fresh anonymous
pages (mmap, every page written), so what earlier tests left in the allocator cannot absorb it."""

import mmap

from megarl.platform import device_memory

MIB = 2**20


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        line = next(line for line in f if line.startswith(field + ":"))
    return int(line.split()[1]) * 1024  # kB


def _pages(nbytes: int) -> mmap.mmap:
    """nbytes of new resident memory."""
    block = mmap.mmap(-1, nbytes)
    for offset in range(0, nbytes, mmap.PAGESIZE):
        block[offset] = 1
    return block


def test_peak_is_the_peak_resident_set_and_resets():
    before = _status("VmRSS")
    block = _pages(256 * MIB)
    assert device_memory.peak_bytes() >= before + 256 * MIB * 0.9
    assert abs(device_memory.peak_bytes() - _status("VmHWM")) <= 0.01 * _status("VmHWM")
    block.close()
    device_memory.reset_peak()
    assert device_memory.peak_bytes() < before + 128 * MIB  # the freed block no longer counts


def test_a_measured_block_reports_its_own_peak_and_keeps_the_outer_one():
    device_memory.reset_peak()
    _pages(192 * MIB).close()  # the "step" held 192 MiB before the block
    with device_memory.measured() as inner:
        held = [_pages(64 * MIB) for _ in range(2)]  # 128 MiB at once inside
        for block in held:
            block.close()
        _pages(32 * MIB).close()  # after the larger peak
    assert 120 * MIB <= inner.extra_bytes <= 160 * MIB, inner.extra_bytes / MIB
    # The step's window still sees its own earlier, larger peak.
    assert device_memory.peak_bytes() >= _status("VmRSS") + 150 * MIB
