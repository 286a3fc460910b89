"""Links: the few collectives the weight sync needs, over the default world or over a bridge.

The sync (megarl.resharding) runs over whichever ranks hold and receive the weights: the training
world itself when the engines are colocated (WorldLinks: torch.distributed's default group), or
the bridge between trainer and rollout ranks when they are disaggregated (BridgeLinks: a process
group of its own, made from the launcher's store; roles.py). A bridge group is not part of any
default world, so torch.distributed's group-rank bookkeeping does not know it: BridgeLinks calls
the process group's own send/recv/allgather, grouped into one NCCL launch per round as
torch.distributed.batch_isend_irecv does, and waits for each with the bridge's timeout: a peer
that died or hangs (a rollout engine) fails the wait with a RuntimeError within it, on NCCL as on
gloo, which the trainer answers by replacing the engine (trainer/disaggregated_rollouts.py).
"""

import contextlib
import datetime
import os
import pickle
from typing import List, Protocol, Sequence, Tuple

import torch
import torch.distributed as dist

from megarl.parallel_state.megatron_groups import device as _device

Transfer = Tuple[torch.Tensor, int]  # a tensor and the peer rank it goes to or comes from


class Links(Protocol):
    name: str  # the same on all of its ranks, and only for this group of these processes
    rank: int
    size: int
    device: torch.device  # where this group's tensors must live

    def all_gather_object(self, obj) -> list:
        """Every rank's `obj`, in rank order."""

    def exchange(self, sends: Sequence[Transfer], recvs: Sequence[Transfer]) -> None:
        """Post every send and receive at once and wait for all of them."""


class WorldLinks:
    """torch.distributed's default group (a world of one without it)."""

    def __init__(self):
        self.name = "world"
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.size = dist.get_world_size() if dist.is_initialized() else 1
        self.device = _device()

    def all_gather_object(self, obj) -> list:
        if self.size == 1:
            return [obj]
        out = [None] * self.size
        dist.all_gather_object(out, obj)
        return out

    def exchange(self, sends: Sequence[Transfer], recvs: Sequence[Transfer]) -> None:
        ops = ([dist.P2POp(dist.isend, t, peer) for t, peer in sends]
               + [dist.P2POp(dist.irecv, t, peer) for t, peer in recvs])
        if ops:
            for request in dist.batch_isend_irecv(ops):
                request.wait()


@contextlib.contextmanager
def _blocking_wait():
    """ProcessGroupNCCL reads TORCH_NCCL_BLOCKING_WAIT when constructed: a group made within
    starts no watchdog, so a failed or timed-out operation raises in the thread that waits for it
    (after aborting the group's communicator). Without it the watchdog takes the whole process down
    (TORCH_NCCL_ASYNC_ERROR_HANDLING's default), not the RuntimeError a dead engine's replacement
    starts from; the training world's own groups keep the watchdog."""
    before = os.environ.get("TORCH_NCCL_BLOCKING_WAIT")
    os.environ["TORCH_NCCL_BLOCKING_WAIT"] = "1"
    try:
        yield
    finally:
        if before is None:
            del os.environ["TORCH_NCCL_BLOCKING_WAIT"]
        else:
            os.environ["TORCH_NCCL_BLOCKING_WAIT"] = before


class BridgeLinks:
    """A process group over both roles, outside the default world; every operation on it raises
    a RuntimeError once `timeout` passes without it completing."""

    def __init__(self, name: str, group, rank: int, size: int, device: torch.device,
                 timeout: datetime.timedelta):
        self.name, self.group, self.rank, self.size, self.device = name, group, rank, size, device
        self.timeout = timeout

    @classmethod
    def start(cls, name: str, store, rank: int, size: int, timeout: datetime.timedelta) -> "BridgeLinks":
        """The group of `size` ranks meeting under `name` in `store` (a new name for every group)."""
        store = dist.PrefixStore(name, store)
        device = _device()
        if device.type == "cuda":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            with _blocking_wait():
                group = dist.ProcessGroupNCCL(store, rank, size, options)
        else:
            group = dist.ProcessGroupGloo(store, rank, size, timeout)
        return cls(name, group, rank, size, device, timeout)

    def _wait(self, work) -> None:
        work.wait(self.timeout)

    def all_gather_object(self, obj) -> list:
        data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8).to(self.device)
        sizes = [torch.zeros(1, dtype=torch.int64, device=self.device) for _ in range(self.size)]
        self._wait(self.group.allgather([sizes], [torch.tensor([data.numel()], device=self.device)]))
        longest = max(int(s) for s in sizes)
        padded = torch.zeros(longest, dtype=torch.uint8, device=self.device)
        padded[:data.numel()] = data
        parts = [torch.empty(longest, dtype=torch.uint8, device=self.device) for _ in range(self.size)]
        self._wait(self.group.allgather([parts], [padded]))
        return [pickle.loads(part[:int(n)].cpu().numpy().tobytes()) for part, n in zip(parts, sizes)]

    def exchange(self, sends: Sequence[Transfer], recvs: Sequence[Transfer]) -> None:
        if not sends and not recvs:
            return
        coalesced = self.device.type == "cuda"  # NCCL: one group launch, or peers can deadlock
        if coalesced:
            self.group._start_coalescing(self.device)
        works: List = [self.group.send([t], peer, 0) for t, peer in sends]
        works += [self.group.recv([t], peer, 0) for t, peer in recvs]
        if coalesced:
            self._wait(self.group._end_coalescing(self.device))
        else:
            for work in works:
                self._wait(work)
