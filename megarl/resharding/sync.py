"""sync_weights: the actor's newest weights into the rollout engine, in buckets, verified.

The one public call of megarl.resharding. Collective over the training world.
"""

import dataclasses
import time
from dataclasses import dataclass
from typing import Dict, Iterable, List, Optional, Tuple

import torch
import torch.distributed as dist

from megarl.models import weight_tables
from megarl.models.hf_config import ModelArch
from megarl.parallel_state import device_memory
from megarl.resharding import metadata, transport
from megarl.resharding.plan import Bucket, Piece, build_plan, engine_piece
from megarl.rollout.engine import RolloutEngine, check_update

DEFAULT_BUCKET_BYTES = 256 * 2**20


@dataclass
class SyncReport:
    params_synced: int        # engine parameters written
    params_expected: int      # engine parameters that exist
    tensors_sent: int         # full Megatron tensors moved between ranks
    tensors_local: int        # full Megatron tensors every rank loaded from its own pieces
    buckets: int
    sync_seconds: float
    peak_extra_bytes: int     # planned: most memory the sync allocated at once (bucket buffers,
                              # joined full tensors and HF-format copies of one bucket)
    measured_peak_bytes: int  # measured: this rank's peak extra memory during the sync, the
                              # engine's own included (parallel_state/device_memory.py)
    model_bytes: int          # all full tensors: what a rank would hold without bucketing
    largest_tensor_bytes: int


@torch.no_grad()
def sync_weights(chunks: List[torch.nn.Module], arch: ModelArch, engine: RolloutEngine,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 rollout_tp: Optional[int] = None) -> SyncReport:
    """`rollout_tp`: the engine's TP size, to pass only for an engine that reads nothing of a
    loaded tensor but its own TP slice (vLLM's weight loaders narrow, then copy). With it, a
    tensor of which every rank already holds its engine's slice (training TP == rollout TP, or
    held whole everywhere) is not sent: each rank loads a full-shaped tensor holding only that
    slice. Without it, every tensor is sent and joined whole."""
    start = time.perf_counter()
    mine, local = metadata.local_pieces(chunks, arch)
    pieces = metadata.all_pieces(mine)
    plan = build_plan(pieces, metadata.expected_tensors(arch), bucket_bytes, rollout_tp,
                      _padded_vocab(arch, pieces))
    rank = dist.get_rank() if dist.is_initialized() else 0
    held: Dict[str, List[Piece]] = {}
    for piece in mine:
        held.setdefault(piece.canonical, []).append(piece)
    device = next(chunks[0].parameters()).device
    with device_memory.measured() as measured:  # the engine's finishing work (repacking) too
        peak = _stream(plan, arch, engine, local, held, rank, rollout_tp, device)
        report = check_update(engine.finish_weight_update())
    return SyncReport(params_synced=report.params_loaded, params_expected=report.params_expected,
                      tensors_sent=sum(not t.local for b in plan for t in b.tensors),
                      tensors_local=sum(t.local for b in plan for t in b.tensors),
                      buckets=len(plan), sync_seconds=time.perf_counter() - start,
                      peak_extra_bytes=peak, measured_peak_bytes=measured.extra_bytes,
                      model_bytes=sum(b.nbytes for b in plan),
                      largest_tensor_bytes=max(t.nbytes for b in plan for t in b.tensors))


def _stream(plan: Tuple[Bucket, ...], arch: ModelArch, engine: RolloutEngine,
            local: Dict[Tuple[str, int], torch.Tensor], held: Dict[str, List[Piece]], rank: int,
            rollout_tp: Optional[int], device: torch.device) -> int:
    """Every bucket into the engine, in plan order; returns the planned peak extra bytes."""
    engine.begin_weight_update()
    peak = 0
    for bucket in plan:
        full, allocated = transport.fetch_bucket(bucket, local, device)
        hf = {}
        for tensor in bucket.tensors:
            entry = weight_tables.entry_for(arch, tensor.canonical)
            if tensor.local:
                piece = engine_piece(held[tensor.canonical], rank, rollout_tp)
                converted, resident = _engine_slice(arch, entry, piece,
                                                    local[(piece.canonical, piece.tp_rank)])
            else:
                source = full[tensor.canonical]
                converted = weight_tables.to_hf(arch, entry, source)
                resident = _new_bytes(converted.values(), source)
            allocated += resident
            hf.update(converted)
        peak = max(peak, allocated)
        engine.load_weights(hf.items())
        del full, hf
    return peak


def _padded_vocab(arch: ModelArch, pieces: Tuple[Piece, ...]) -> frozenset:
    """Vocabulary tensors sharded with padding rows: Megatron pads to a multiple of 128 * tp,
    the engine pads its own way, so their shards need not cover the same rows."""
    vocab = {row.megatron for row in weight_tables.rows(arch) if row.transform == "vocab"}
    return frozenset(p.canonical for p in pieces if p.canonical in vocab and p.tp_dim is not None
                     and p.shape[0] * p.tp_size != arch.vocab_size)


def _new_bytes(tensors: Iterable[torch.Tensor], source: torch.Tensor) -> int:
    """Bytes of the tensors that are not views of `source` (splits and slices cost nothing)."""
    base = source.untyped_storage().data_ptr()
    return sum(t.numel() * t.element_size() for t in tensors
               if t.untyped_storage().data_ptr() != base)


def _engine_slice(arch: ModelArch, entry: weight_tables.Entry, piece: Piece,
                  shard: torch.Tensor) -> Tuple[Dict[str, torch.Tensor], int]:
    """HF tensors of one entry, full-shaped but holding only this rank's engine slice, and the
    bytes they occupy. to_hf of a TP shard is that shard of to_hf of the full tensor (QKV is split
    per GQA group, gate/up per half, an unpadded vocabulary by rows), so each HF shard is placed
    at its TP offset; the rest stays uninitialized, unread by the engine's loaders."""
    if piece.tp_dim is None:
        converted = weight_tables.to_hf(arch, entry, shard)
        return converted, _new_bytes(converted.values(), shard)
    n, dim = piece.tp_size, piece.tp_dim
    shard_arch = dataclasses.replace(arch, num_heads=arch.num_heads // n,
                                     num_kv_heads=arch.num_kv_heads // n,
                                     vocab_size=shard.shape[0])
    converted, resident = {}, 0
    for name, part in weight_tables.to_hf(shard_arch, entry, shard).items():
        shape = list(part.shape)
        shape[dim] *= n
        whole = part.new_empty(shape)
        whole.narrow(dim, piece.tp_rank * part.shape[dim], part.shape[dim]).copy_(part)
        converted[name] = whole
        # A slice along dim 0 touches only its own pages; along a later dim, every row's.
        resident += (part if dim == 0 else whole).numel() * part.element_size()
    return converted, resident
