"""The environment megarl's Ray workers are given. A Ray worker starts from its node's raylet
environment, not the driver's: on a cluster started outside the sbatch script (`--ray-address`),
NCCL/InfiniBand settings exported where the trainer was started would otherwise reach no worker,
and NCCL would pick its own interfaces.

gloo needs an interface too: vLLM builds a gloo group over every rank, and on the CPU megarl's
own groups and the trainer-rollout bridge are gloo. Unless GLOO_SOCKET_IFNAME names one, gloo
binds the address the hostname resolves to, a loopback address on many distributions
(/etc/hosts), where other nodes' connections never arrive: a multi-node run hangs at its first
gloo group. So each worker without it takes gloo_interface's choice, made on its own node
(scripts/slurm/env.sh makes the same choice for a Slurm job)."""

import socket
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

# NCCL and its network plugins (InfiniBand, UCX), PyTorch's NCCL and gloo knobs, Transformer
# Engine's switches, megarl's own device and Transformer Engine choices, and the trackers' (rank 0
# logs from a worker: WANDB_MODE online and its API key, or MLflow's tracking credentials, set
# where the trainer was started, must reach it).
PREFIXES = ("NCCL_", "TORCH_NCCL_", "UCX_", "NVTE_", "GLOO_SOCKET_IFNAME", "MEGARL_DEVICE",
            "MEGARL_TRANSFORMER_ENGINE", "WANDB_", "MLFLOW_")


def worker_env(environ: Mapping[str, str], gpus: bool) -> Dict[str, str]:
    """Pure: the variables to set in every worker. With GPUs every worker sees all of its node's
    devices and picks its own by LOCAL_RANK, as under torchrun."""
    env = {name: value for name, value in environ.items() if name.startswith(PREFIXES)}
    if gpus:
        env["RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"] = "1"
    return env


def _nccl_selects(spec: str, name: str) -> bool:
    """Whether NCCL_SOCKET_IFNAME=`spec` lets NCCL use interface `name`: comma-separated name
    prefixes, each an exact name after a leading `=`, all of them excluded after a leading `^`."""
    exclude = spec.startswith("^")
    spec = spec[1:] if exclude else spec
    exact = spec.startswith("=")
    spec = spec[1:] if exact else spec
    listed = any(name == item if exact else name.startswith(item) for item in spec.split(",") if item)
    return listed != exclude


def gloo_interface(environ: Mapping[str, str], interfaces: Sequence[Tuple[str, str]],
                   head_route: Optional[str]) -> Optional[str]:
    """Pure: the GLOO_SOCKET_IFNAME to set on a node, or None to leave gloo as it is.
    `interfaces`: the node's (name, IPv4 address) pairs in the system's order; `head_route`: the
    node's address on its route to the head (rank 0's node), None where unknown.
    GLOO_SOCKET_IFNAME given: kept. NCCL_SOCKET_IFNAME given: the first interface it selects (where
    NCCL bootstraps; an exclusion never selects a loopback one), so gloo and NCCL share the network
    the user chose; none selected is refused. Otherwise the interface holding `head_route`."""
    if environ.get("GLOO_SOCKET_IFNAME"):
        return None
    nccl = environ.get("NCCL_SOCKET_IFNAME")
    if nccl:
        for name, address in interfaces:
            if _nccl_selects(nccl, name) and not (nccl.startswith("^") and address.startswith("127.")):
                return name
        raise ValueError(f"NCCL_SOCKET_IFNAME={nccl!r} selects none of this node's interfaces "
                         f"{[f'{name} {address}' for name, address in interfaces]}; set it (and "
                         "GLOO_SOCKET_IFNAME, which defaults to the first it selects) to the interface "
                         "the nodes reach each other on")
    return next((name for name, address in interfaces if address == head_route), None)


def node_interfaces() -> List[Tuple[str, str]]:
    """This node's (interface, IPv4 address) pairs, in the system's order."""
    import psutil

    return [(name, a.address) for name, addresses in psutil.net_if_addrs().items()
            for a in addresses if a.family == socket.AF_INET]


def route_address(host: str) -> Optional[str]:
    """This node's address on its route to `host` (a UDP socket's connect sends nothing), or None
    when there is no route."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect((host, 9))
        except OSError:
            return None
        return probe.getsockname()[0]
