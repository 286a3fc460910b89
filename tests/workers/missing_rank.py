"""torchrun worker: every rank joins megarl's groups with a short collective timeout, then rank 1
never reaches the all-reduce the others wait in (as a stuck or dead rank would). Rank 0 prints
one JSON line with how long it waited and what it raised; rank 1 stays alive (an exited rank would
fail the others at once, not by the timeout) until rank 0 is done. `--group bridge`: the same over
the trainer-rollout bridge (links.BridgeLinks, as roles.py starts it), rank 1 an engine that never
takes its part of a weight push."""

import argparse
import datetime
import json
import os
import time

import torch
import torch.distributed as dist

from megarl.parallel_state import megatron_groups, roles
from megarl.parallel_state.dims import ParallelDims
from megarl.parallel_state.links import BridgeLinks


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--timeout-s", type=float, required=True)
    parser.add_argument("--group", choices=["world", "data_parallel", "bridge"], required=True)
    args = parser.parse_args()
    if args.group == "bridge":
        return _bridge(args.timeout_s)
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


def _bridge(timeout_s: float) -> None:
    """Rank 0 pushes to rank 1 over a bridge of this timeout; rank 1 joined it but never receives."""
    store = roles.launcher_store(roles.Placement(1, 1, 60 + 3 * timeout_s))
    rank = int(os.environ["RANK"])
    links = BridgeLinks.start("megarl/bridge/test", store, rank, 2, datetime.timedelta(seconds=timeout_s))
    if rank == 1:
        store.wait(["done"], datetime.timedelta(seconds=60 + 3 * timeout_s))
        return
    start, error, runtime_error = time.time(), None, False
    try:
        links.exchange([(torch.ones(4), 1)], [(torch.empty(4), 1)])
    except Exception as caught:
        # what the trainer takes for an engine's death (disaggregated_rollouts.py)
        error, runtime_error = f"{type(caught).__name__}: {caught}", isinstance(caught, RuntimeError)
    print(json.dumps({"waited_s": time.time() - start, "error": error, "runtime_error": runtime_error}),
          flush=True)
    store.set("done", "1")


if __name__ == "__main__":
    main()
