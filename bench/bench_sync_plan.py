"""A weight sync's planning work, the first time and later: one rank's host seconds, no weights.

  .venv/bin/python bench/bench_sync_plan.py [--quick] [--rank R] [--repeats N]

Default layout: Qwen3-235B-A22B (docs/configs/qwen3-235b-a22b.json) trained at TP4 PP2 CP2 EP16
ETP1 on 8 nodes x 8 GPUs, synced into rollout TP8 engines in 256 MiB buckets: the 256 MiB row
of docs/PERFORMANCE.md "Weight sync at cluster scale". --quick: a small layout (Qwen3-30B-A3B cut
to 4 layers, TP2 EP4 ETP1 on one node of 4 into rollout TP4), for `make bench`.

A 64-rank sync cannot run here, so this runs, on one rank, what sync_weights does between its
start and moving bytes, its collective left out: metadata.local_pieces (a walk over this rank's
parameters, here the rank's own Megatron chunks built on the meta device as the memory planner
builds them: the same modules and names, no weights), the digest of its pieces its metadata
exchange gathers (metadata.digest), and finding its share of the plan (sync.rank_plan: the
destination layout, the plan, this rank's work). The pieces of every other rank are
source_layout.layout_pieces' (what metadata.gather returns in a live run; this rank's own must
be theirs, in its own order, or the bench stops).
  local_pieces_s  metadata.local_pieces alone, median of the later syncs' (in reuse_s)
  first_build_s   the first sync's: local_pieces, digest, the plan built
  reuse_s         a later sync's: local_pieces, digest, the same plan found (median of --repeats)
  planned_sync_s  the sync's planned seconds (cluster_plan.plan_cluster: the same plan, costed
                  with the GPU kind's measured constants: --gpu, else the visible GPU's, else h100)
  reuse_share     reuse_s / planned_sync_s; target <= 0.01
The last line printed is one JSON object.
"""

import argparse
import json
import os
import statistics
import time
import warnings

from megarl.models.hf.config import ModelArch
from megarl.models.megatron.builder import build_model
from megarl.parallel_state import megatron_groups
from megarl.resharding import cluster_plan as cp
from megarl.resharding import gpu_kinds, metadata, sync
from megarl.resharding.source_layout import layout_pieces
from megarl.rollout.engine import WeightLayout

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

TARGET_SHARE = 0.01
FULL = dict(config="qwen3-235b-a22b.json", train="tp=4,pp=2,cp=2,ep=16,etp=1", rollout="tp=8",
            nodes=8, gpus_per_node=8)
QUICK = dict(config="qwen3-30b-a3b.json", layers=4, train="tp=2,ep=4,etp=1", rollout="tp=4", nodes=1,
             gpus_per_node=4)


def planning(chunks, arch, layout: WeightLayout, pieces, digests, bucket_bytes: int, node_of, rank: int):
    """sync_weights' work on `rank` before it moves bytes, its collective left out: this rank's
    pieces read from its chunks and digested, as every sync does; `digests` is what the other
    ranks would send. Returns (this rank's plan, its pieces, seconds of local_pieces)."""
    start = time.perf_counter()
    mine, _ = metadata.local_pieces(chunks, arch, rank)
    read = time.perf_counter() - start
    key = ("world", digests[:rank] + (metadata.digest(mine),) + digests[rank + 1:])
    work = sync.rank_plan(arch, layout, metadata.Gathered(key, pieces), bucket_bytes, node_of, rank)
    return work, mine, read


def timed(fn):
    """fn's result, wall seconds and this process's CPU seconds (which other processes on a
    loaded machine do not inflate)."""
    start, cpu = time.perf_counter(), time.process_time()
    result = fn()
    return result, time.perf_counter() - start, time.process_time() - cpu


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a small layout, for `make bench`")
    parser.add_argument("--rank", type=int, default=0, help="the rank whose planning is timed")
    parser.add_argument("--repeats", type=int, default=9, help="later syncs timed (the median is reported)")
    parser.add_argument("--bucket-mb", type=float, default=256.0)
    parser.add_argument("--gpu", default=None, metavar="|".join(gpu_kinds.KINDS),
                        help="the GPU kind whose measured constants cost planned_sync_s (default: the "
                             "visible GPU's, else h100)")
    args = parser.parse_args()
    try:
        kind, how = gpu_kinds.choose(args.gpu, None if args.gpu else gpu_kinds.visible_device())
    except ValueError as error:
        parser.error(str(error))
    spec = QUICK if args.quick else FULL
    with open(os.path.join(ROOT, "docs", "configs", spec["config"])) as f:
        arch = cp.arch_of(json.load(f))
    if "layers" in spec:
        arch = ModelArch(**{**arch.to_dict(), "num_layers": spec["layers"]})
    world = spec["nodes"] * spec["gpus_per_node"]
    dims, rollout = cp.train_dims(spec["train"], world), cp.rollout_layout(spec["rollout"])
    if not 0 <= args.rank < world:
        parser.error(f"--rank {args.rank} is outside the {world} ranks")
    bucket_bytes = int(args.bucket_mb * 2**20)
    node_of = tuple(rank // spec["gpus_per_node"] for rank in range(world))
    layout = WeightLayout("vllm", world, rollout.tp, rollout.ep)

    pieces, pieces_s, _ = timed(lambda: layout_pieces(arch, dims))  # a live run gathers them instead
    by_rank = [[] for _ in range(world)]
    for piece in pieces:
        by_rank[piece.rank].append(piece)
    digests = tuple(metadata.digest(mine) for mine in by_rank)

    with megatron_groups.fake_world(dims, args.rank), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Megatron's notes on running the config
        chunks, model_s, _ = timed(lambda: build_model(arch, dims, meta=True))  # once a run: not timed

        def plan():
            return planning(chunks, arch, layout, pieces, digests, bucket_bytes, node_of, args.rank)

        first, first_s, first_cpu_s = timed(plan)
        reuses = [timed(plan) for _ in range(args.repeats)]
    (plan_first, mine, _) = first
    if len(mine) != len(by_rank[args.rank]) or set(mine) != set(by_rank[args.rank]):  # order aside
        raise SystemExit(f"rank {args.rank}'s local_pieces ({len(mine)}) differ from layout_pieces' "
                         f"({len(by_rank[args.rank])}): the bench would time another plan than a sync's")
    info = sync.rank_plan.cache_info()
    planned = cp.plan_cluster(arch, dims, rollout, spec["gpus_per_node"], bucket_bytes, cp.Links.of(kind))
    reuse_s = statistics.median(s for _, s, _ in reuses)
    result = {
        "case": "sync_plan_quick" if args.quick else "sync_plan",
        "model": spec["config"], "train": spec["train"], "rollout": spec["rollout"], "world": world,
        "rank": args.rank, "bucket_bytes": bucket_bytes, "buckets": len(plan_first.buckets),
        "rank_copies": sum(len(c) for _, rounds in plan_first.buckets for c in rounds),
        "plan_copies": planned.copies, "pieces": len(pieces), "rank_pieces": len(mine),
        "layout_pieces_s": round(pieces_s, 3), "meta_model_s": round(model_s, 3),
        "first_build_s": round(first_s, 3), "first_build_cpu_s": round(first_cpu_s, 3),
        "local_pieces_s": statistics.median(read for (_, _, read), _, _ in reuses),
        "reuse_s": reuse_s, "reuse_cpu_s": statistics.median(c for _, _, c in reuses),
        "reuse_s_all": [round(s, 6) for _, s, _ in reuses],
        "plans_built": info.misses,
        "reused_same_plan": all(p is plan_first for (p, _, _), _, _ in reuses),
        "gpu": kind.name, "gpu_chosen_by": how,
        "planned_sync_s": round(planned.seconds, 4),
        "plan_cluster_build_s": round(planned.plan_seconds, 3),
        "reuse_share": reuse_s / planned.seconds, "target_share": TARGET_SHARE,
        "holds": reuse_s / planned.seconds <= TARGET_SHARE,
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
