"""The one adapter between megarl and Megatron-Core's global parallel state.

Owns: starting torch.distributed (nccl with CUDA, gloo without) and, once per world, the ranks'
agreement on the layer spec (device_choice.spec_refusal, before any model can be built), creating
Megatron's process groups for a validated ParallelDims, a second layout's groups in the same world
beside them (`create_layout`, swapped in by `using`: a distillation teacher at a layout of its
own), seeding, tearing it all down, and every
read of that state: this rank's place on each parallel axis (`tensor()`, `context()`, ... -> Axis)
and its pipeline stage. Nothing else in megarl imports `megatron.core.parallel_state`
(tests/test_architecture.py).
"""

import contextlib
import datetime
import os
from dataclasses import dataclass
from typing import Callable, Iterator, Optional

import torch
import torch.distributed as dist

from megarl.parallel_state.dims import ParallelDims
from megarl.platform import cpu_compat, device_choice, no_te_compat


def backend() -> str:
    return "nccl" if device_choice.on_gpu() else "gloo"


def device() -> torch.device:
    """Where this rank computes and where its collectives' tensors live (device_choice)."""
    return device_choice.collective_device()


def init_distributed(timeout_s: float = 600.0, say: Callable[[str], None] = print) -> int:
    """Start the default process group from torchrun/Ray environment variables (or join the one
    already started), have its ranks agree on the layer spec (`agree_on_layer_spec`, `say`ing what
    the job runs without Transformer Engine); return world size."""
    if not dist.is_initialized():
        if device_choice.on_gpu():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        if "RANK" not in os.environ:
            # A single process started without a launcher is a world of one.
            os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0",
                              MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get(
                                  "MASTER_PORT", str(free_port())))
        dist.init_process_group(backend=backend(),
                                timeout=datetime.timedelta(seconds=timeout_s))
    agree_on_layer_spec(say)
    return dist.get_world_size()


_AGREED = None  # the world whose ranks agreed on the layer spec


def agree_on_layer_spec(say: Callable[[str], None] = print) -> None:
    """Every entry point (the loop's ranks under torchrun or Ray, converters, scripts) starts its
    world through init_distributed, so this is where the ranks' layer specs meet: each rank's
    choice is gathered once per world and a job whose ranks chose differently (Transformer Engine
    importable on one node, not another) or could not choose is refused on every rank, naming
    them. Where they agree, rank 0 `say`s each node's Transformer-Engine-off line once."""
    global _AGREED
    world = dist.group.WORLD
    if _AGREED is world:
        return
    choices = [None] * dist.get_world_size()
    dist.all_gather_object(choices, device_choice.this_choice(dist.get_rank()))
    refusal = device_choice.spec_refusal(choices)
    if refusal:
        raise RuntimeError(refusal)
    _AGREED = world
    if dist.get_rank() == 0:
        for line in device_choice.node_lines(choices):
            say(line)


def _create_groups(dims: ParallelDims, timeout_s: float) -> None:
    """Megatron's groups for `dims`, made current (collective over the world)."""
    _mpu().initialize_model_parallel(
        **dims.megatron_sizes(),
        distributed_timeout_minutes=timeout_s / 60,  # Megatron makes a timedelta of it: no rounding
        # Megatron's gloo copies of its data-parallel groups serve only its distributed
        # optimizer's own checkpoint formats (the parameter state gathered over them); megarl
        # saves each rank's optimizer state itself (trainer/checkpoint.py) and builds the
        # optimizer without them (use_gloo_process_groups=False). On GPUs they would be unused
        # groups, each one more gloo mesh that must find a routable interface on a multi-node job
        # (GLOO_SOCKET_IFNAME). On the CPU the groups themselves are gloo.
        create_gloo_process_groups=False,
    )


def initialize(dims: ParallelDims, seed: int = 1234, timeout_s: float = 600.0) -> None:
    """Create Megatron-Core's groups for `dims` on the current world and seed every RNG."""
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    world = init_distributed(timeout_s)
    if world != dims.world_size:
        raise ValueError(
            f"layout {dims.describe()} expects world size {dims.world_size}, but "
            f"torch.distributed has {world} processes: launch with --nproc-per-node "
            f"{dims.world_size} or change the layout"
        )
    no_te_compat.install()
    cpu_compat.install()
    mpu = _mpu()
    if mpu.model_parallel_is_initialized():
        mpu.destroy_model_parallel()
    _create_groups(dims, timeout_s)
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)


@dataclass(frozen=True)
class Layout:
    """Megatron's groups for `dims` on this rank, made by create_layout and current only inside
    `using(layout)`. `state`: Megatron's parallel_state globals for them."""
    dims: ParallelDims
    state: dict


def _state() -> dict:
    """Megatron-Core keeps its groups, ranks and sizes in parallel_state's module globals, all
    named _UPPER_CASE; everything that reads a layout reads them (its getters, its schedules'
    p2p, its modules' pg_collection at construction)."""
    return {name: value for name, value in vars(_mpu()).items()
            if name.startswith("_") and name.isupper() and not callable(value)}


def _set_state(state: dict) -> None:
    for name, value in state.items():
        setattr(_mpu(), name, value)


def create_layout(dims: ParallelDims, timeout_s: float = 600.0) -> Layout:
    """Megatron's groups for a second layout `dims` in the running world, the current groups (the
    actor's) left current. Collective over the world: every rank creates every group. The new
    groups are only ever used inside `using(layout)`."""
    if not dist.is_initialized() or dist.get_world_size() != dims.world_size:
        raise ValueError(f"layout {dims.describe()} expects world size {dims.world_size}; the running "
                         f"world has {dist.get_world_size() if dist.is_initialized() else 0} processes")
    current = _state()
    try:
        # initialize_model_parallel refuses groups already set: start from its module's defaults
        _set_state({name: {} if isinstance(value, dict) else None for name, value in current.items()})
        _create_groups(dims, timeout_s)
        return Layout(dims, _state())
    finally:
        _set_state(current)


@contextlib.contextmanager
def using(layout: Layout) -> Iterator[None]:
    """Within the block `layout`'s groups are Megatron's current ones (every getter here and in
    Megatron answers for it); after it, those current before. Build and run a model of that
    layout only inside it: Megatron's modules capture the groups current at construction, its
    schedules read them at each call."""
    current = _state()
    _set_state(layout.state)
    try:
        yield
    finally:
        # what Megatron set lazily inside (its memory buffers) stays the layout's
        layout.state.update(_state())
        _set_state(current)


@contextlib.contextmanager
def fake_world(dims: ParallelDims, rank: int) -> Iterator[None]:
    """Within the block this process is rank `rank` of a world of dims.world_size with Megatron's
    groups for `dims`, and no peers: torch's fake backend answers every collective without
    communicating. For building a rank's model on the meta device (models/memory/held_params.py) before
    any real process group exists; refused inside a running job, whose groups it would replace."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("fake_world inside a process group: size models before init_distributed")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=dims.world_size)
    try:
        no_te_compat.install()
        cpu_compat.install()
        _mpu().initialize_model_parallel(**dims.megatron_sizes(), create_gloo_process_groups=False)
        yield
    finally:
        destroy()


def destroy() -> None:
    global _AGREED
    _AGREED = None
    mpu = _mpu()
    if mpu.model_parallel_is_initialized():
        mpu.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def free_port() -> int:
    """A TCP port free on every interface of this machine (a store served to other nodes binds
    them all)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


@dataclass(frozen=True)
class Axis:
    """This rank's place along one parallel dimension of the current Megatron layout."""
    rank: int
    size: int
    group: object  # torch.distributed ProcessGroup of the ranks along this axis


def _mpu():
    from megatron.core import parallel_state as mpu  # lazy: config checks run without Megatron

    return mpu


def _axis(name: str) -> Axis:
    """Megatron names every dimension's getters alike: get_<name>_rank/_world_size/_group."""
    mpu = _mpu()
    return Axis(getattr(mpu, f"get_{name}_rank")(), getattr(mpu, f"get_{name}_world_size")(),
                getattr(mpu, f"get_{name}_group")())


def tensor() -> Axis:
    return _axis("tensor_model_parallel")


def context() -> Axis:
    return _axis("context_parallel")


def data() -> Axis:
    """Data parallel, not counting context-parallel ranks (they hold the same sequences)."""
    return _axis("data_parallel")


def pipeline() -> Axis:
    return _axis("pipeline_model_parallel")


def expert() -> Axis:
    return _axis("expert_model_parallel")


def expert_tensor() -> Axis:
    return _axis("expert_tensor_parallel")


def virtual_stages() -> int:
    """Model chunks per pipeline rank (1 without interleaving)."""
    return _mpu().get_virtual_pipeline_model_parallel_world_size() or 1


def is_first_stage(vp_stage: Optional[int] = None) -> bool:
    """This rank's pipeline stage holds the embedding; with `vp_stage`, that model chunk does."""
    if vp_stage is None:
        return _mpu().is_pipeline_first_stage()
    return _mpu().is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage)


def is_last_stage(vp_stage: Optional[int] = None) -> bool:
    """This rank's pipeline stage holds the output layer; with `vp_stage`, that model chunk does."""
    if vp_stage is None:
        return _mpu().is_pipeline_last_stage()
    return _mpu().is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage)


def is_rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0
