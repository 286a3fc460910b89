"""The weight sync's cost per Copy on this host: what scripts/plan_sync.py's --copy-us stands for.

  python bench/bench_sync_copies.py [--quick] [--device cpu|cuda]

A rollout TP8 rank of a 128-expert MoE handles ~73k Copies per sync (a gate, an up and a down
slab of every expert of every layer, and as many sends), so the host work per Copy, not the
bytes, can set the sync's time. This times transport._exchange_round on a world of one: one
round of local copies, each a gate or up slab of one expert into vLLM's fused `w13` (the shape
a TP8 engine takes of Qwen3-MoE experts, scaled down), against one `copy_` per slab (what the
transport did before it batched a round's writes) and against building the views alone (the
part no batching removes). Prints one JSON object: microseconds per Copy for each; and the two
bandwidths the planner takes: packing a send buffer (the transport's torch.cat of the same slabs:
plan_sync.py --pack-gbps) and one plain warm copy of --copy-mib MiB (--hbm-gbps). With --device
cuda the tensors live on the GPU and each timing ends with a synchronize, so a Copy's time is its
host work plus its share of the kernels. The GPU figures in docs/PERFORMANCE.md (a Qwen3-30B-A3B
TP8 rank's slabs, and DeepSeek-V3-sized ones):
  python bench/bench_sync_copies.py --device cuda --experts 128 --hidden 2048 --width 768
  python bench/bench_sync_copies.py --device cuda --experts 64 --hidden 7168 --width 2048
"""

import argparse
import json
import statistics
import time

import torch

from megarl.resharding import transport
from megarl.resharding.plan import Copy


class _Alone:
    """What the transport uses of Links, for a world of one: every Copy is local, nothing is sent."""
    rank = 0

    def __init__(self, device: torch.device):
        self.device = device

    def exchange(self, sends, recvs) -> None:
        raise AssertionError(f"a world of one posted {len(sends)} sends and {len(recvs)} receives")


def _device(name: str) -> torch.device:
    if name == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"--device cuda: torch {torch.__version__} sees no usable GPU; "
                         f"use --device cpu, or run on a machine with CUDA")
    return torch.device(name)


def _copies(experts: int, width: int, hidden: int, tp: int, dtype: torch.dtype, device: torch.device):
    local = {(f"experts.{e}.fc1", 0): torch.randn(2 * width, hidden, device=device).to(dtype)
             for e in range(experts)}
    targets = {"w13": torch.empty(experts, 2 * width // tp, hidden, dtype=dtype, device=device)}
    rows = width // tp
    copies = tuple(Copy(0, 0, f"experts.{e}.fc1", 0, 0, half * width, rows, "w13", e, half * rows,
                        rows * hidden, str(dtype))
                   for e in range(experts) for half in range(2))
    return copies, local, targets


def _seconds(run, repeats: int, device: torch.device) -> float:
    """Median seconds of one call of `run`."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        if device.type == "cuda":  # the kernels, not only their launches
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _per_copy_us(run, copies, repeats: int, device: torch.device) -> float:
    return _seconds(run, repeats, device) / len(copies) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer repeats")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--width", type=int, default=192, help="expert width (intermediate size)")
    parser.add_argument("--copy-mib", type=int, default=1024, help="the plain copy's size (quick: 64)")
    args = parser.parse_args()
    torch.set_num_threads(1)  # one rank's share of the host
    device = _device(args.device)
    copies, local, targets = _copies(args.experts, args.width, args.hidden, 8, torch.bfloat16, device)
    links = _Alone(device)
    traffic = transport.Traffic()
    repeats = 20 if args.quick else 200

    def batched():
        transport._exchange_round(copies, links, local, targets, traffic)

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
    traffic.local_bytes = 0
    batched()
    assert torch.equal(targets["w13"], expected), "the batched round wrote the wrong slabs"
    assert traffic.local_bytes == targets["w13"].numel() * targets["w13"].element_size(), \
        f"the transport counted {traffic.local_bytes} local bytes for the {targets['w13'].nbytes} it wrote"
    slab_bytes = sum(c.nbytes for c in copies)
    copy_bytes = (64 if args.quick else args.copy_mib) * 2**20
    plain = torch.ones(copy_bytes // 2, dtype=torch.bfloat16, device=device)
    into = torch.zeros_like(plain)  # written once before timing: no first-touch page faults

    def pack():
        return torch.cat([transport._source(c, local).reshape(-1) for c in copies])

    print(json.dumps({
        "bench": "sync_copies", "device": str(device), "copies": len(copies),
        "slab_bytes": copies[0].nbytes,
        "batched_us_per_copy": _per_copy_us(batched, copies, repeats, device),
        "one_copy_each_us_per_copy": _per_copy_us(one_each, copies, repeats, device),
        "views_only_us_per_copy": _per_copy_us(views, copies, repeats, device),
        "pack_GBps": slab_bytes / _seconds(pack, repeats, device) / 1e9,
        "plain_copy_GBps": copy_bytes / _seconds(lambda: into.copy_(plain), repeats, device) / 1e9,
        "threads": torch.get_num_threads()}))

if __name__ == "__main__":
    main()
