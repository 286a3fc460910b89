"""Moving one bucket's pieces to every rank and joining them into full Megatron tensors.

One broadcast per owner rank per bucket: the owner packs its pieces into one flat buffer, every
rank receives it (NCCL on GPU, gloo on CPU). With one rank, nothing moves; local tensors (see
plan.py) are not moved either: sync.py reads them from this rank's own pieces. Memory in flight:
the bucket's flat buffers plus the joined full tensors.
"""

from typing import Dict, Tuple

import torch
import torch.distributed as dist

from megarl.models.hf_config import DTYPES
from megarl.models.param_layout import join_shards
from megarl.resharding.plan import Bucket

_DTYPES = {str(dtype): dtype for dtype in DTYPES.values()}  # Piece.dtype -> torch.dtype


def fetch_bucket(bucket: Bucket, local: Dict[Tuple[str, int], torch.Tensor],
                 device: torch.device) -> Tuple[Dict[str, torch.Tensor], int]:
    """Full tensors of the bucket's non-local tensors on every rank, and the bytes this call
    allocated."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    sent = [t for t in bucket.tensors if not t.local]
    received: Dict[Tuple[str, int], torch.Tensor] = {}
    allocated = 0
    for owner in bucket.owners():
        pieces = [p for t in sent for p in t.pieces if p.rank == owner]
        dtype = _DTYPES[pieces[0].dtype]
        if any(p.dtype != pieces[0].dtype for p in pieces):
            raise ValueError(f"rank {owner} holds mixed dtypes in one bucket: "
                             f"{sorted({p.dtype for p in pieces})}")
        if owner == rank:
            flat = torch.cat([local[(p.canonical, p.tp_rank)].reshape(-1) for p in pieces])
        else:
            flat = torch.empty(sum(p.numel for p in pieces), dtype=dtype, device=device)
        allocated += flat.numel() * flat.element_size()
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.broadcast(flat, src=owner)
        for piece, part in zip(pieces, flat.split([p.numel for p in pieces])):
            received[(piece.canonical, piece.tp_rank)] = part.view(piece.shape)
    full = {}
    for tensor in sent:
        parts = [received[(p.canonical, p.tp_rank)] for p in tensor.pieces]
        first = tensor.pieces[0]
        full[tensor.canonical] = join_shards(parts, first.tp_dim, first.glu)
        if len(parts) > 1:
            allocated += full[tensor.canonical].numel() * full[tensor.canonical].element_size()
    return full, allocated
