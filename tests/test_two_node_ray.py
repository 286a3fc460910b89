"""Multi-node, simulated on one machine: a Ray cluster of two nodes (two raylets, each with CPUs of
its own: ray.cluster_utils.Cluster), joined by scripts/train_ppo_moe.py --ray-address as a Slurm
job's trainer joins its cluster, runs a step of the demo on 3 ranks, 2 on one node and 1 on the
other. Each rank's log names its node and the settings it got (launch.py): ranks are numbered node
by node, every rank got the driver's network settings (set only where the driver started, not in
the nodes' raylets) and gloo's interface chosen on its own node, and the weight sync across the
two nodes left vLLM's log-probs on the actor's."""

import json
import os
import re

import pytest

from megarl.trainer import placement
from megarl.trainer.worker_env import node_interfaces, worker_env
from tests.launch import ray_pids, run

FORWARDED = {"NCCL_IB_HCA": "mlx5_two_node_test"}  # harmless on the CPU path
RANK_LINE = re.compile(r"megarl: rank (\d+) of 3 on Ray node (\w+) \((\S+)\), local rank (\d+) of (\d+); "
                       r"settings: (.*)")


@pytest.fixture(scope="module")
def two_nodes():
    """A head with 1 CPU and a second node with 2, started with this process's environment (which
    lacks FORWARDED): the cluster and {node id: its CPUs}. Every one of its processes ends with it."""
    from ray.cluster_utils import Cluster

    assert not set(FORWARDED) & set(os.environ)
    before = ray_pids()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    try:
        second = cluster.add_node(num_cpus=2)
        cluster.wait_for_nodes()
        yield cluster, {cluster.head_node.node_id: 1, second.node_id: 2}
    finally:
        cluster.shutdown()
    assert ray_pids() <= before, f"Ray processes left by the cluster: {ray_pids() - before}"


def test_a_step_across_two_nodes(two_nodes, demo_inputs, tmp_path):
    cluster, cpus = two_nodes
    run_dir = tmp_path / "run"
    run("scripts/train_ppo_moe.py", "--ray-address", cluster.address, "--config", "configs/demo_cpu.yaml",
        f"model.hf_dir={demo_inputs / 'model'}", f"model.megatron_dir={demo_inputs / 'megatron'}",
        f"data.path={demo_inputs / 'train.jsonl'}", f"run_dir={run_dir}", "steps=1", "layout.world_size=3",
        "layout.ep=1", "data.prompts_per_step=6", "algo.advantage=grpo", "algo.kl_reward_coeff=0",
        "checkpoint.every=0", "checkpoint.export_hf=false", env=FORWARDED, timeout=600)
    ranks = []
    for rank in range(3):
        (line,) = [m for m in map(RANK_LINE.match, (run_dir / "logs" / f"rank{rank}.log").read_text()
                                  .splitlines()) if m]
        ranks.append(line.groups())
    assert [int(r[0]) for r in ranks] == [0, 1, 2]
    nodes = [r[1] for r in ranks]
    # Ranks node by node (whichever node Ray lists first), each node holding as many as it has
    # CPUs, local ranks counted within it.
    assert nodes == sorted(nodes, key=nodes.index) and {n: nodes.count(n) for n in nodes} == cpus
    local = [(nodes[:rank].count(node), cpus[node]) for rank, node in enumerate(nodes)]
    assert [(int(r[3]), int(r[4])) for r in ranks] == local
    # Every rank got the driver's network settings, and gloo the interface holding its node's
    # address instead of the hostname's (a loopback address on many distributions).
    interface = {address: name for name, address in node_interfaces()}
    driver = worker_env({**os.environ, **FORWARDED}, gpus=False)
    for rank in ranks:
        gloo = driver.get("GLOO_SOCKET_IFNAME", interface[rank[2]])
        assert dict(item.split("=", 1) for item in rank[5].split()) == {**driver, "GLOO_SOCKET_IFNAME": gloo}
    # The engines (1 rank each) stayed within nodes; one of all 3 ranks would span both, and is
    # refused for the slots Ray gave.
    with pytest.raises(ValueError, match=r"the rollout engine of ranks 0-2 would span nodes .*: the "
                                         r"Ray cluster gave the job \[2, 1\] slots per node"):
        placement.check_groups_within_nodes(nodes, {"rollout engine": 3})
    (step,) = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    # vLLM's log-probs are the actor's: the start-up sync reached both nodes' engines.
    assert step["mismatch/logprob_diff_max"] < 1e-4, step

