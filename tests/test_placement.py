"""Ray ranks numbered node by node (megarl/trainer/placement.py), and groups that would span nodes
refused naming the fix."""

import random

import pytest

from megarl.trainer.placement import check_groups_within_nodes, ranks_by_node


def test_interleaved_bundles_become_consecutive_ranks_per_node():
    nodes = ["b", "a", "b", "a", "c", "a", "b", "c"]
    order = ranks_by_node(nodes)
    assert sorted(order) == list(range(len(nodes)))
    assert [nodes[i] for i in order] == ["b", "b", "b", "a", "a", "a", "c", "c"]
    assert order[:3] == [0, 2, 6]  # within a node, workers keep their order


@pytest.mark.parametrize("seed", range(20))
def test_fuzz_every_node_is_one_run_of_ranks(seed):
    rng = random.Random(seed)
    per_node = [rng.choice([2, 4, 8]) for _ in range(rng.randint(1, 5))]
    nodes = [f"n{k}" for k, count in enumerate(per_node) for _ in range(count)]
    rng.shuffle(nodes)
    by_rank = [nodes[i] for i in ranks_by_node(nodes)]
    runs = [node for i, node in enumerate(by_rank) if i == 0 or by_rank[i - 1] != node]
    assert len(runs) == len(set(runs)) == len(per_node)
    check_groups_within_nodes(by_rank, {"tensor-parallel group": 2})  # every node holds 2k slots


def test_a_group_across_two_nodes_is_refused_naming_the_fix():
    by_rank = ["a"] * 6 + ["b"] * 2
    check_groups_within_nodes(by_rank, {"tensor-parallel group": 2, "rollout engine": 2})
    with pytest.raises(ValueError, match=r"the rollout engine of ranks 4-7 would span nodes \['a', 'b'\]: "
                                         r"the Ray cluster gave the job \[6, 2\] slots per node, and every "
                                         r"node needs a multiple of 4"):
        check_groups_within_nodes(by_rank, {"tensor-parallel group": 2, "rollout engine": 4})
