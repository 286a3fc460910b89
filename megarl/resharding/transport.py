"""Moving one bucket's copies: point-to-point between the ranks that hold and need them.

A large slab of rows goes as its own message straight from the source parameter into the
destination tensor (no copy on either side); the rest a rank sends to one peer is packed into one
flat buffer per dtype. All messages of a round are posted at once
(torch.distributed.batch_isend_irecv: NCCL on GPU, gloo on CPU). A copy whose source
and destination are the same rank is written directly, without a buffer. Memory in flight: this
rank's send and receive buffers of one round (plan.py keeps them within the bucket size).
"""

from typing import Dict, List, Tuple

import torch
import torch.distributed as dist

from megarl.models.hf_config import DTYPES
from megarl.resharding.plan import Bucket, Copy

_DTYPES = {str(dtype): dtype for dtype in DTYPES.values()}  # Piece.dtype -> torch.dtype
DIRECT_BYTES = 256 * 2**10


def _source(copy: Copy, local: Dict[Tuple[str, int], torch.Tensor]) -> torch.Tensor:
    return local[(copy.canonical, copy.tp_rank)].narrow(copy.dim, copy.src_start, copy.length)


def _target(copy: Copy, targets: Dict[str, torch.Tensor]) -> torch.Tensor:
    tensor = targets[copy.tensor]
    if copy.expert is not None:
        tensor = tensor[copy.expert]
    return tensor.narrow(copy.dim, copy.dst_start, copy.length)


def exchange(bucket: Bucket, rank: int, local: Dict[Tuple[str, int], torch.Tensor],
             targets: Dict[str, torch.Tensor], device: torch.device) -> Tuple[int, int]:
    """Fill this rank's `targets` with the bucket's copies, round by round; returns (most bytes
    of buffers allocated at once, messages this rank sent)."""
    peak = messages = 0
    for copies in bucket.rounds:
        allocated, sent = _exchange_round(copies, rank, local, targets, device)
        peak, messages = max(peak, allocated), messages + sent
    return peak, messages


def _direct(copy: Copy) -> bool:
    """Sent as its own message, straight from the source tensor into the target: a large slab
    of rows, contiguous on both sides (params are contiguous; a slab along dim 0 of a contiguous
    tensor, or of one expert of it, is too). Smaller or column slabs share one packed buffer per
    peer, so per-message costs stay bounded. Both ends decide from the plan alone."""
    return copy.dim == 0 and copy.nbytes >= DIRECT_BYTES


def _exchange_round(round_copies: Tuple[Copy, ...], rank: int,
                    local: Dict[Tuple[str, int], torch.Tensor], targets: Dict[str, torch.Tensor],
                    device: torch.device) -> Tuple[int, int]:
    sends: Dict[Tuple[int, str], List[Copy]] = {}
    recvs: Dict[Tuple[int, str], List[Copy]] = {}
    ops, received, staged = [], [], []
    for copy in round_copies:
        if copy.src == rank == copy.dst:
            _target(copy, targets).copy_(_source(copy, local))
        elif copy.src == rank and _direct(copy):
            ops.append(dist.P2POp(dist.isend, _source(copy, local), copy.dst))
        elif copy.dst == rank and _direct(copy):
            target = _target(copy, targets)
            if target.dtype != _DTYPES[copy.dtype]:  # the engine casts: receive, then copy
                staged.append((target, torch.empty(target.shape, dtype=_DTYPES[copy.dtype], device=device)))
                target = staged[-1][1]
            ops.append(dist.P2POp(dist.irecv, target, copy.src))
        elif copy.src == rank:
            sends.setdefault((copy.dst, copy.dtype), []).append(copy)
        elif copy.dst == rank:
            recvs.setdefault((copy.src, copy.dtype), []).append(copy)
    if not ops and not sends and not recvs:
        return 0, 0
    allocated = sum(buffer.numel() * buffer.element_size() for _, buffer in staged)
    for (peer, _), copies in sends.items():
        flat = torch.cat([_source(c, local).reshape(-1) for c in copies])
        ops.append(dist.P2POp(dist.isend, flat, peer))
        allocated += flat.numel() * flat.element_size()
    for (peer, dtype), copies in recvs.items():
        flat = torch.empty(sum(c.numel for c in copies), dtype=_DTYPES[dtype], device=device)
        ops.append(dist.P2POp(dist.irecv, flat, peer))
        received.append((copies, flat))
        allocated += flat.numel() * flat.element_size()
    for request in dist.batch_isend_irecv(ops):
        request.wait()
    for target, buffer in staged:
        target.copy_(buffer)
    for copies, flat in received:
        for copy, part in zip(copies, flat.split([c.numel for c in copies])):
            target = _target(copy, targets)
            target.copy_(part.view(target.shape))
    return allocated, sum(op.op is dist.isend for op in ops)
