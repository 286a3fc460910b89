"""sync_weights: the actor's newest weights into the rollout engine, in buckets, verified.

The one public call of megarl.resharding. Collective over the training world.
"""

import time
from dataclasses import dataclass
from typing import List

import torch

from megarl.models import weight_tables
from megarl.models.hf_config import ModelArch
from megarl.resharding import metadata, transport
from megarl.resharding.plan import build_plan
from megarl.rollout.engine import RolloutEngine, check_update

DEFAULT_BUCKET_BYTES = 256 * 2**20


@dataclass
class SyncReport:
    params_synced: int        # engine parameters written
    params_expected: int      # engine parameters that exist
    tensors_sent: int         # full Megatron tensors moved
    buckets: int
    sync_seconds: float
    peak_extra_bytes: int     # most memory the sync allocated at once (bucket buffers, joined
                              # full tensors and HF-format copies of one bucket; an upper bound)
    model_bytes: int          # all full tensors: what a rank would hold without bucketing
    largest_tensor_bytes: int


@torch.no_grad()
def sync_weights(chunks: List[torch.nn.Module], arch: ModelArch, engine: RolloutEngine,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> SyncReport:
    start = time.perf_counter()
    mine, local = metadata.local_pieces(chunks, arch)
    plan = build_plan(metadata.all_pieces(mine), metadata.expected_tensors(arch), bucket_bytes)
    device = next(chunks[0].parameters()).device
    engine.begin_weight_update()
    peak = 0
    for bucket in plan:
        full, allocated = transport.fetch_bucket(bucket, local, device)
        hf = {}
        for canonical, tensor in full.items():
            hf.update(weight_tables.to_hf(arch, weight_tables.entry_for(arch, canonical), tensor))
        allocated += sum(t.numel() * t.element_size() for t in hf.values())
        peak = max(peak, allocated)
        engine.load_weights(hf.items())
        del full, hf
    report = check_update(engine.finish_weight_update())
    return SyncReport(params_synced=report.params_loaded, params_expected=report.params_expected,
                      tensors_sent=sum(len(b.tensors) for b in plan), buckets=len(plan),
                      sync_seconds=time.perf_counter() - start, peak_extra_bytes=peak,
                      model_bytes=sum(b.nbytes for b in plan),
                      largest_tensor_bytes=max(t.nbytes for b in plan for t in b.tensors))
