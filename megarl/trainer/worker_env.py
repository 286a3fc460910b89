"""The environment megarl's Ray workers are given. A Ray worker starts from its node's raylet
environment, not the driver's: on a cluster started outside the sbatch script (`--ray-address`),
NCCL/InfiniBand settings exported where the trainer was started would otherwise reach no worker,
and NCCL would pick its own interfaces."""

from typing import Dict, Mapping

# NCCL and its network plugins (InfiniBand, UCX), PyTorch's NCCL and gloo knobs, Transformer
# Engine's switches, and megarl's own device choice.
PREFIXES = ("NCCL_", "TORCH_NCCL_", "UCX_", "NVTE_", "GLOO_SOCKET_IFNAME", "MEGARL_DEVICE")


def worker_env(environ: Mapping[str, str], gpus: bool) -> Dict[str, str]:
    """Pure: the variables to set in every worker. With GPUs every worker sees all of its node's
    devices and picks its own by LOCAL_RANK, as under torchrun."""
    env = {name: value for name, value in environ.items() if name.startswith(PREFIXES)}
    if gpus:
        env["RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"] = "1"
    return env
