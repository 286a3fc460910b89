"""Which Ray worker becomes which rank: a node's workers as consecutive ranks, so Megatron's
tensor-parallel groups (consecutive ranks, TP fastest) and the rollout engines (consecutive
`rollout size` ranks) stay within a node, where NVLink is, and the weight sync's node map
(LOCAL_WORLD_SIZE) is true. Pure; launch.py applies it to the nodes Ray reports."""

from typing import Dict, List, Sequence


def ranks_by_node(nodes: Sequence[str]) -> List[int]:
    """The worker index that takes each rank: workers grouped by node (nodes in the order they
    first appear, workers in their order within a node). A PACK placement group may interleave
    its bundles over nodes; this undoes that."""
    first = {node: i for i, node in reversed(list(enumerate(nodes)))}
    return sorted(range(len(nodes)), key=lambda i: (first[nodes[i]], i))


def check_groups_within_nodes(nodes_by_rank: Sequence[str], groups: Dict[str, int]) -> None:
    """Raise ValueError naming the group and the nodes' slot counts when a group of consecutive
    ranks (`groups`: name -> size) would span two nodes."""
    counts: Dict[str, int] = {}
    for node in nodes_by_rank:
        counts[node] = counts.get(node, 0) + 1
    for name, size in groups.items():
        for start in range(0, len(nodes_by_rank), size):
            spanned = list(dict.fromkeys(nodes_by_rank[start:start + size]))
            if len(spanned) > 1:
                raise ValueError(
                    f"the {name} of ranks {start}-{start + size - 1} would span nodes {spanned}: the "
                    f"Ray cluster gave the job {sorted(counts.values(), reverse=True)} slots per node, "
                    f"and every node needs a multiple of {size}; start each node's Ray with a multiple "
                    f"of {size} GPUs (ray start --num-gpus) or change layout.world_size")
