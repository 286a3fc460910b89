"""torchrun worker: every rank joins megarl's groups with a short collective timeout, then rank 1
never reaches the all-reduce the others wait in (as a stuck or dead rank would). Rank 0 prints
one JSON line with how long it waited and what it raised; rank 1 stays alive (an exited rank would
fail the others at once, not by the timeout) until rank 0 is done."""

import argparse
import datetime
import json
import time

import torch
import torch.distributed as dist

from megarl.parallel_state import megatron_groups
from megarl.parallel_state.dims import ParallelDims


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--timeout-s", type=float, required=True)
    parser.add_argument("--group", choices=["world", "data_parallel"], required=True)
    args = parser.parse_args()
    world = megatron_groups.init_distributed(args.timeout_s)
    megatron_groups.initialize(ParallelDims(world_size=world), timeout_s=args.timeout_s)
    group = None if args.group == "world" else megatron_groups.data().group
    # A group of its own with a long timeout, where rank 1 waits for rank 0 to finish (sooner
    # than sleeping a fixed multiple of the timeout).
    done = dist.new_group(timeout=datetime.timedelta(seconds=60 + 3 * args.timeout_s))
    if dist.get_rank() == 1:
        dist.barrier(group=done)
        return
    start = time.time()
    try:
        dist.all_reduce(torch.ones(1), group=group)
        error = None
    except Exception as caught:  # what gloo raises on a timeout differs between versions
        error = f"{type(caught).__name__}: {caught}"
    print(json.dumps({"waited_s": time.time() - start, "error": error}), flush=True)
    dist.barrier(group=done)


if __name__ == "__main__":
    main()
