"""What megarl's Ray workers are given from the driver's environment, and the interface gloo is
given on each node (megarl/trainer/worker_env.py)."""

import pytest

from megarl.trainer.worker_env import gloo_interface, node_interfaces, route_address, worker_env

DRIVER = {"NCCL_IB_HCA": "mlx5_0,mlx5_1", "NCCL_SOCKET_IFNAME": "ib0", "TORCH_NCCL_BLOCKING_WAIT": "1",
          "UCX_NET_DEVICES": "mlx5_0:1", "NVTE_FUSED_ATTN": "0", "GLOO_SOCKET_IFNAME": "eth0",
          "MEGARL_DEVICE": "cuda", "MEGARL_TRANSFORMER_ENGINE": "off", "HOME": "/home/u", "PATH": "/usr/bin",
          "CUDA_VISIBLE_DEVICES": "0", "MY_NCCL_NOTE": "x", "SLURM_JOB_ID": "7", "WANDB_MODE": "online",
          "WANDB_API_KEY": "k", "MLFLOW_TRACKING_TOKEN": "t", "MY_WANDB_NOTE": "y"}


def test_network_and_device_settings_reach_workers_and_nothing_else():
    forwarded = {"NCCL_IB_HCA", "NCCL_SOCKET_IFNAME", "TORCH_NCCL_BLOCKING_WAIT", "UCX_NET_DEVICES",
                 "NVTE_FUSED_ATTN", "GLOO_SOCKET_IFNAME", "MEGARL_DEVICE", "MEGARL_TRANSFORMER_ENGINE",
                 "WANDB_MODE", "WANDB_API_KEY", "MLFLOW_TRACKING_TOKEN"}
    assert worker_env(DRIVER, gpus=False) == {name: DRIVER[name] for name in forwarded}
    # a node's own paths and device list are the raylet's, not the driver's
    on_gpus = worker_env(DRIVER, gpus=True)
    assert on_gpus.pop("RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES") == "1"
    assert set(on_gpus) == forwarded


def test_nothing_set_nothing_forwarded():
    assert worker_env({"HOME": "/root"}, gpus=False) == {}


# A node in the system's order (loopback first), as scripts/slurm/env.sh's tests have it.
NODE = [("lo", "127.0.0.1"), ("eth0", "10.0.0.5"), ("ib0", "10.1.0.5"), ("ib1", "10.2.0.5")]


@pytest.mark.parametrize("environ, head_route, chosen", [
    ({}, "10.0.0.5", "eth0"),  # the interface this node reaches the head from
    ({}, "10.1.0.5", "ib0"),
    ({}, "127.0.0.1", "lo"),  # the head on this node, at a loopback address: one node
    ({}, "192.168.0.9", None),  # an address no interface holds: gloo left to itself
    ({}, None, None),  # no route to the head
    # NCCL's own choice, its first interface: prefixes, exact names (=), exclusions (^)
    ({"NCCL_SOCKET_IFNAME": "ib"}, "10.0.0.5", "ib0"),
    ({"NCCL_SOCKET_IFNAME": "=ib1,eth0"}, "10.1.0.5", "eth0"),
    ({"NCCL_SOCKET_IFNAME": "^docker"}, "10.1.0.5", "eth0"),  # an exclusion never selects loopback
    ({"NCCL_SOCKET_IFNAME": "^lo,eth"}, "10.0.0.5", "ib0"),
    ({"NCCL_SOCKET_IFNAME": "^=ib0,eth0,lo"}, "10.0.0.5", "ib1"),
    ({"GLOO_SOCKET_IFNAME": "ib1", "NCCL_SOCKET_IFNAME": "eth"}, "10.0.0.5", None),  # given: kept
])
def test_gloo_interface_is_nccls_or_the_route_to_the_heads(environ, head_route, chosen):
    """Without one gloo binds the hostname's address, a loopback one on many distributions, which
    no other node reaches: a multi-node run hangs at its first gloo group."""
    assert gloo_interface(environ, NODE, head_route) == chosen


@pytest.mark.parametrize("nccl", ["enp", "=ib"])
def test_nccl_interfaces_that_match_nothing_are_refused(nccl):
    with pytest.raises(ValueError) as refused:
        gloo_interface({"NCCL_SOCKET_IFNAME": nccl}, NODE, "10.0.0.5")
    assert str(refused.value) == (
        f"NCCL_SOCKET_IFNAME='{nccl}' selects none of this node's interfaces ['lo 127.0.0.1', "
        "'eth0 10.0.0.5', 'ib0 10.1.0.5', 'ib1 10.2.0.5']; set it (and GLOO_SOCKET_IFNAME, which "
        "defaults to the first it selects) to the interface the nodes reach each other on")


def test_each_address_of_this_node_is_reached_from_its_own_interface():
    """The probes on this machine, as on a head node: the route to an address it holds starts from
    that address, and gloo gets the interface holding it."""
    interfaces = node_interfaces()
    assert ("lo", "127.0.0.1") in interfaces
    for name, address in interfaces:
        assert route_address(address) == address
        assert gloo_interface({}, interfaces, route_address(address)) == name
