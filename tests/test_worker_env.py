"""What megarl's Ray workers are given from the driver's environment (megarl/trainer/worker_env.py)."""

from megarl.trainer.worker_env import worker_env

DRIVER = {"NCCL_IB_HCA": "mlx5_0,mlx5_1", "NCCL_SOCKET_IFNAME": "ib0", "TORCH_NCCL_BLOCKING_WAIT": "1",
          "UCX_NET_DEVICES": "mlx5_0:1", "NVTE_FUSED_ATTN": "0", "GLOO_SOCKET_IFNAME": "eth0",
          "MEGARL_DEVICE": "cuda", "HOME": "/home/u", "PATH": "/usr/bin", "CUDA_VISIBLE_DEVICES": "0",
          "MY_NCCL_NOTE": "x", "SLURM_JOB_ID": "7"}


def test_network_and_device_settings_reach_workers_and_nothing_else():
    forwarded = {"NCCL_IB_HCA", "NCCL_SOCKET_IFNAME", "TORCH_NCCL_BLOCKING_WAIT", "UCX_NET_DEVICES",
                 "NVTE_FUSED_ATTN", "GLOO_SOCKET_IFNAME", "MEGARL_DEVICE"}
    assert worker_env(DRIVER, gpus=False) == {name: DRIVER[name] for name in forwarded}
    # a node's own paths and device list are the raylet's, not the driver's
    on_gpus = worker_env(DRIVER, gpus=True)
    assert on_gpus.pop("RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES") == "1"
    assert set(on_gpus) == forwarded


def test_nothing_set_nothing_forwarded():
    assert worker_env({"HOME": "/root"}, gpus=False) == {}
