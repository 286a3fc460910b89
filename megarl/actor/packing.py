"""Packing sequences for compute: data-parallel balance, micro-batches, and the thd layout.

Pure functions of lengths and indices (no process groups): every rank holds the whole batch and
derives the same plan. Sequences are concatenated without padding between them, except what the
parallel layout needs: with context parallelism each sequence is padded to a multiple of 2 * cp
(each CP rank holds chunks r and 2cp-1-r of every sequence, Megatron's load-balanced split), and
the pack is padded at its end to a multiple of tp (sequence parallelism splits it over TP ranks).
Glossary: N sequences in the batch, n in a micro-batch, t packed tokens, W widest row.
Does not own running the model (schedule.py).
"""

import math
from dataclasses import dataclass
from typing import List, Optional

import torch

from megarl.models.megatron.portable_layers import cp_positions


def balanced_partition(weights: List[int], parts: int) -> List[List[int]]:
    """Split item indices into `parts` non-empty lists of near-equal total weight (longest item
    to the lightest part), each list in ascending index order."""
    if len(weights) < parts:
        raise ValueError(f"{len(weights)} sequences cannot fill {parts} parts; use a larger batch "
                         f"(or mini-batch) or fewer data-parallel ranks / micro-batches")
    bins = [[] for _ in range(parts)]
    loads = [0] * parts
    for index in sorted(range(len(weights)), key=lambda i: (-weights[i], i)):
        target = min(range(parts), key=lambda p: (loads[p], len(bins[p]), p))
        bins[target].append(index)
        loads[target] += weights[index]
    return [sorted(b) for b in bins]


def plan_micro_batches(lengths: List[int], dp_size: int, micro_batch_tokens: Optional[int] = None,
                       micro_batches: int = 1, min_micro_batches: int = 1) -> List[List[List[int]]]:
    """[dp rank][micro-batch] -> indices into `lengths`. Sequences are balanced by tokens over DP
    ranks, then split into micro-batches: the fewest (at least `min_micro_batches`, which the
    interleaved pipeline schedule needs) that keep each under `micro_batch_tokens` (if given),
    else `micro_batches`. Every DP rank gets the same count (expert-parallel all-to-alls pair the
    ranks' micro-batches)."""
    longest = max(lengths)
    if micro_batch_tokens is not None and longest > micro_batch_tokens:
        raise ValueError(f"a sequence of {longest} tokens exceeds micro_batch_tokens="
                         f"{micro_batch_tokens}; raise micro_batch_tokens to at least {longest}")
    per_rank = balanced_partition(lengths, dp_size)
    count = micro_batches
    if micro_batch_tokens is not None:
        count = max([min_micro_batches] + [math.ceil(sum(lengths[i] for i in rank) / micro_batch_tokens)
                                           for rank in per_rank])
        while any(max(sum(lengths[rank[i]] for i in part) for part in
                      balanced_partition([lengths[i] for i in rank], count)) > micro_batch_tokens
                  for rank in per_rank):
            count += 1
    if count < min_micro_batches:
        raise ValueError(f"micro_batches={count} but the interleaved pipeline schedule needs at least "
                         f"{min_micro_batches} (the pipeline size) per data-parallel rank")
    plan = []
    for rank in per_rank:
        parts = balanced_partition([lengths[i] for i in rank], count)
        plan.append([[rank[i] for i in part] for part in parts])
    return plan


def padded_lengths(lengths: List[int], tp: int, cp: int) -> List[int]:
    """Each sequence to a multiple of 2*cp (cp > 1), the last one further so that the pack
    splits evenly over CP and then TP ranks."""
    align = 2 * cp if cp > 1 else 1
    padded = [-(-n // align) * align for n in lengths]
    total_align = align * tp
    padded[-1] += -sum(padded) % total_align
    return padded


@dataclass(frozen=True)
class PackedMicroBatch:
    rows: torch.Tensor  # [n] long, batch rows in pack order
    lengths: torch.Tensor  # [n] long, real tokens per sequence
    cu_seqlens: torch.Tensor  # [n+1] int32, real lengths
    cu_seqlens_padded: torch.Tensor  # [n+1] int32, padded lengths (pack coordinates)
    local_index: torch.Tensor  # [t/cp] long, pack positions held by this CP rank
    tokens: torch.Tensor  # [1, t/cp] input ids at local_index
    targets: torch.Tensor  # [1, t/cp] the next token of the same sequence (0 where none)
    padding: torch.Tensor  # [1, t/cp] bool, True at padding positions (no sequence's token)

    @property
    def max_seqlen(self) -> int:
        return int((self.cu_seqlens_padded[1:] - self.cu_seqlens_padded[:-1]).max())

    @property
    def width(self) -> int:
        return int(self.lengths.max())


def pack(tokens: torch.Tensor,  # [N, L] right-padded
         lengths: torch.Tensor,  # [N]
         rows: List[int], tp: int, cp: int, cp_rank: int) -> PackedMicroBatch:
    lens = [int(lengths[r]) for r in rows]
    padded = padded_lengths(lens, tp, cp)
    cu = torch.tensor([0] + lens).cumsum(0).to(torch.int32)
    cu_padded = torch.tensor([0] + padded).cumsum(0).to(torch.int32)
    full = torch.zeros(int(cu_padded[-1]), dtype=torch.long)
    targets = torch.zeros_like(full)
    padding = torch.ones_like(full, dtype=torch.bool)
    for row, start, n in zip(rows, cu_padded[:-1].tolist(), lens):
        full[start:start + n] = tokens[row, :n]
        targets[start:start + n - 1] = tokens[row, 1:n]
        padding[start:start + n] = False
    local = local_positions(cu_padded, cp, cp_rank)
    return PackedMicroBatch(rows=torch.tensor(rows), lengths=torch.tensor(lens), cu_seqlens=cu,
                            cu_seqlens_padded=cu_padded, local_index=local,
                            tokens=full[local][None], targets=targets[local][None],
                            padding=padding[local][None])


def local_positions(cu_seqlens_padded: torch.Tensor, cp: int, cp_rank: int) -> torch.Tensor:
    """Pack positions [t/cp] that CP rank `cp_rank` holds, in its order."""
    bounds = cu_seqlens_padded.tolist()
    return torch.cat([start + cp_positions((end - start) // cp, cp_rank, cp, None) if cp > 1
                      else torch.arange(start, end) for start, end in zip(bounds[:-1], bounds[1:])])


def unpack_predictions(values: torch.Tensor,  # [t, ...] full pack order
                       mb: PackedMicroBatch) -> torch.Tensor:
    """Outputs at pack position p predict token p+1: row j column i <- position start_j + i - 1.
    Returns [n, W, ...], 0 in column 0 and beyond each length. Differentiable."""
    width = mb.width
    cols = torch.arange(width)
    index = (mb.cu_seqlens_padded[:-1, None].long() + cols[None, :] - 1).to(values.device)  # [n, W]
    valid = ((cols[None, :] >= 1) & (cols[None, :] < mb.lengths[:, None])).to(values.device)
    picked = values[index.clamp(0, values.shape[0] - 1).flatten()].reshape(*index.shape, *values.shape[1:])
    return torch.where(valid.reshape(*valid.shape, *[1] * (values.dim() - 1)), picked, 0)


def unpack_tokens(values: torch.Tensor,  # [t, ...] full pack order
                  mb: PackedMicroBatch, fill) -> torch.Tensor:
    """Per-input-token values (e.g. routing): row j column i <- position start_j + i; [n, W, ...]."""
    cols = torch.arange(mb.width)
    index = mb.cu_seqlens_padded[:-1, None].long() + cols[None, :]  # [n, W]
    valid = cols[None, :] < mb.lengths[:, None]
    index, valid = torch.where(valid, index, 0).to(values.device), valid.to(values.device)
    picked = values[index.flatten()].reshape(*index.shape, *values.shape[1:])
    return torch.where(valid.reshape(*valid.shape, *[1] * (values.dim() - 1)), picked, fill)


def pack_tokens(rows_values: torch.Tensor,  # [n, W, ...] per input token
                mb: PackedMicroBatch, fill) -> torch.Tensor:
    """Inverse of unpack_tokens: [t, ...] in full pack order, `fill` on padding positions."""
    total = int(mb.cu_seqlens_padded[-1])
    out = torch.full((total, *rows_values.shape[2:]), fill, dtype=rows_values.dtype)
    for j, (start, n) in enumerate(zip(mb.cu_seqlens_padded[:-1].tolist(), mb.lengths.tolist())):
        out[start:start + n] = rows_values[j, :n]
    return out
