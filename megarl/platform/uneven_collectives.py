"""All-gather and reduce-scatter of parts whose sizes differ per rank, along dim 0.

gloo's all_gather and reduce_scatter need equal sizes, so both pad every part to the largest and
trim afterwards. Used by the CPU shims for Megatron-Core (cpu_compat.py) and for vLLM
(megarl/rollout/vllm/cpu_fixes.py), which both lack these on CPU.
"""

from typing import List

import torch
import torch.distributed as dist


def all_gather_uneven(part: torch.Tensor, sizes: List[int], group) -> torch.Tensor:
    """Every rank's `part` ([sizes[rank], ...]) concatenated in rank order: [sum(sizes), ...]."""
    largest = max(sizes)
    padded = part.new_zeros(largest, *part.shape[1:])
    padded[: part.shape[0]] = part
    out = part.new_empty(largest * len(sizes), *part.shape[1:])
    dist.all_gather_into_tensor(out, padded.contiguous(), group=group)
    return torch.cat([chunk[:n] for chunk, n in zip(out.split(largest), sizes)])


def reduce_scatter_uneven(full: torch.Tensor, sizes: List[int], group) -> torch.Tensor:
    """Sum of every rank's `full` ([sum(sizes), ...]), of which this rank keeps its slice."""
    largest = max(sizes)
    stacked = full.new_zeros(largest * len(sizes), *full.shape[1:])
    for i, chunk in enumerate(full.split(sizes)):
        stacked[i * largest: i * largest + chunk.shape[0]] = chunk
    out = full.new_empty(largest, *full.shape[1:])
    dist.reduce_scatter_tensor(out, stacked, group=group)
    return out[: sizes[dist.get_rank(group)]]
