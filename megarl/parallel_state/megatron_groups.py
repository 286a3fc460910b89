"""The one adapter between megarl and Megatron-Core's global parallel state.

Owns: starting torch.distributed (nccl with CUDA, gloo without), creating Megatron's process
groups for a validated ParallelDims, seeding, and tearing it all down. Nothing else in megarl
calls `megatron.core.parallel_state` initialization functions.
"""

import datetime
import os

import torch
import torch.distributed as dist

from megarl.parallel_state import cpu_compat
from megarl.parallel_state.dims import ParallelDims


def backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def init_distributed(timeout_s: float = 600.0) -> int:
    """Start the default process group from torchrun/Ray environment variables; return world size."""
    if not dist.is_initialized():
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        if "RANK" not in os.environ:
            # A single process started without a launcher is a world of one.
            os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0",
                              MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get(
                                  "MASTER_PORT", str(free_port())))
        dist.init_process_group(backend=backend(),
                                timeout=datetime.timedelta(seconds=timeout_s))
    return dist.get_world_size()


def initialize(dims: ParallelDims, seed: int = 1234, timeout_s: float = 600.0) -> None:
    """Create Megatron-Core's groups for `dims` on the current world and seed every RNG."""
    from megatron.core import parallel_state as mpu
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    world = init_distributed(timeout_s)
    if world != dims.world_size:
        raise ValueError(
            f"layout {dims.describe()} expects world size {dims.world_size}, but "
            f"torch.distributed has {world} processes: launch with --nproc-per-node "
            f"{dims.world_size} or change the layout"
        )
    cpu_compat.install()
    if mpu.model_parallel_is_initialized():
        mpu.destroy_model_parallel()
    mpu.initialize_model_parallel(
        tensor_model_parallel_size=dims.tp,
        pipeline_model_parallel_size=dims.pp,
        virtual_pipeline_model_parallel_size=dims.vpp,
        context_parallel_size=dims.cp,
        expert_model_parallel_size=dims.ep,
        expert_tensor_parallel_size=dims.expert_tp,
        distributed_timeout_minutes=timeout_s / 60,  # Megatron makes a timedelta of it: no rounding
        create_gloo_process_groups=torch.cuda.is_available(),
    )
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)


def destroy() -> None:
    from megatron.core import parallel_state as mpu

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


def is_rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0
