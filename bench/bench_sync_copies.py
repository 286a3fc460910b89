"""The weight sync's cost per Copy on this host: what scripts/plan_sync.py's --copy-us stands for.

  python bench/bench_sync_copies.py [--quick]

A rollout TP8 rank of a 128-expert MoE handles ~73k Copies per sync (a gate, an up and a down
slab of every expert of every layer, and as many sends), so the host work per Copy, not the
bytes, can set the sync's time. This times transport._exchange_round on a world of one: one
round of local copies, each a gate or up slab of one expert into vLLM's fused `w13` (the shape
a TP8 engine takes of Qwen3-MoE experts, scaled down), against one `copy_` per slab (what the
transport did before it batched a round's writes) and against building the views alone (the
part no batching removes). Prints one JSON object: microseconds per Copy for each.
"""

import argparse
import json
import statistics
import time

import torch

from megarl.resharding import transport
from megarl.resharding.plan import Copy


def _copies(experts: int, width: int, hidden: int, tp: int, dtype: torch.dtype):
    local = {(f"experts.{e}.fc1", 0): torch.randn(2 * width, hidden).to(dtype) for e in range(experts)}
    targets = {"w13": torch.empty(experts, 2 * width // tp, hidden, dtype=dtype)}
    rows = width // tp
    copies = tuple(Copy(0, 0, f"experts.{e}.fc1", 0, 0, half * width, rows, "w13", e, half * rows,
                        rows * hidden, str(dtype))
                   for e in range(experts) for half in range(2))
    return copies, local, targets


def _per_copy_us(run, copies, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times) / len(copies) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer repeats")
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--width", type=int, default=192, help="expert width (intermediate size)")
    args = parser.parse_args()
    torch.set_num_threads(1)  # one rank's share of the host
    copies, local, targets = _copies(args.experts, args.width, args.hidden, 8, torch.bfloat16)
    cpu = torch.device("cpu")
    repeats = 20 if args.quick else 200

    def batched():
        transport._exchange_round(copies, 0, local, targets, cpu)

    def one_each():
        for c in copies:
            transport._target(c, targets).copy_(transport._source(c, local))

    def views():
        return [(transport._target(c, targets), transport._source(c, local)) for c in copies]

    for run in (batched, one_each, views):  # warm up
        run()
    expected = torch.stack([torch.cat([local[(c.canonical, 0)][c.src_start:c.src_start + c.length]
                                       for c in copies[2 * e:2 * e + 2]]) for e in range(args.experts)])
    targets["w13"].zero_()
    batched()
    assert torch.equal(targets["w13"], expected), "the batched round wrote the wrong slabs"
    print(json.dumps({
        "bench": "sync_copies", "copies": len(copies), "slab_bytes": copies[0].nbytes,
        "batched_us_per_copy": _per_copy_us(batched, copies, repeats),
        "one_copy_each_us_per_copy": _per_copy_us(one_each, copies, repeats),
        "views_only_us_per_copy": _per_copy_us(views, copies, repeats),
        "threads": torch.get_num_threads()}))

if __name__ == "__main__":
    main()
