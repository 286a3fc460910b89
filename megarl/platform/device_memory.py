"""Measured memory of this rank's device: the peak since a reset, and the peak extra memory of a
block of code (`measured()`), on GPU from PyTorch's allocator and on CPU from the kernel's count
of the process's resident set (Linux: VmRSS, and VmHWM, which /proc/self/clear_refs resets).

Windows nest: a window resets the device's counter, and the peak it saw is carried over to the
windows around it, so a sync measured inside a step leaves the step's own peak intact.
Does not own what is allowed (the callers' bounds) or planning memory (resharding/plan.py).
"""

import contextlib
from dataclasses import dataclass
from typing import Iterator

import torch

from megarl.platform import device_choice


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        line = next(line for line in f if line.startswith(field + ":"))
    return int(line.split()[1]) * 1024  # kB


def in_use_bytes() -> int:
    """GPU: PyTorch's allocated bytes (NCCL and other non-PyTorch buffers are not counted). CPU:
    the resident set."""
    return torch.cuda.memory_allocated() if device_choice.on_gpu() else _status_bytes("VmRSS")


def _counter() -> int:
    return torch.cuda.max_memory_allocated() if device_choice.on_gpu() else _status_bytes("VmHWM")


def _reset_counter() -> None:
    if device_choice.on_gpu():
        torch.cuda.reset_peak_memory_stats()
    else:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current resident set


class _Carried:
    """The highest peak measured before the counter's last reset inside a still-open window."""
    bytes = 0


def peak_bytes() -> int:
    """The most memory in use since the last reset_peak() (since start on CPU without one)."""
    return max(_Carried.bytes, _counter())


def reset_peak() -> None:
    """Start a new peak window for peak_bytes() (e.g. per training step)."""
    _reset_counter()
    _Carried.bytes = 0


@dataclass
class Measured:
    extra_bytes: int = 0  # the block's peak minus what was in use when it started


@contextlib.contextmanager
def measured() -> Iterator[Measured]:
    """Measure the block's peak extra memory; the enclosing peak_bytes() window keeps its peak."""
    outer = peak_bytes()
    start = in_use_bytes()
    _reset_counter()
    result = Measured()
    try:
        yield result
    finally:
        inner = _counter()
        result.extra_bytes = max(0, inner - start)
        _Carried.bytes = max(outer, inner)
