"""Disaggregated placement: the launcher's processes split into trainer ranks and rollout ranks.

The launcher (torchrun, megarl's Ray launch, srun) starts trainer_world + rollout_world
processes; global ranks [0, trainer_world) train and the rest run the rollout engines. Each role
gets its own torch.distributed default world over its own ranks, so Megatron-Core (whose groups
are built over the default world) and vLLM's external launcher (which joins it) each see exactly
their own ranks, unchanged. Both roles also join a bridge group over all ranks (bridge rank ==
global rank: trainers first), which carries the weight pushes (megarl.resharding over Links), and
share the launcher's key-value store, which carries rollouts and control (rollout_ranks/channel.py).

A rollout rank's engine runs in a child process of the launcher's (rollout_ranks/supervisor.py), so a
dead engine can be replaced: each replacement is a new generation, with a rollout world and a
bridge of its own (the trainers join the new bridge when they see the generation change).

Owns: which role a process has, starting each role's world and the bridge from the launcher's
environment. Does not own what either role runs.
"""

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megarl.parallel_state import megatron_groups
from megarl.parallel_state.links import BridgeLinks
from megarl.platform import device_choice

TRAINER, ROLLOUT = "trainer", "rollout"


@dataclass(frozen=True)
class Placement:
    trainer_world: int   # global ranks [0, trainer_world) train; the rest roll out
    rollout_world: int
    timeout_s: float

    @property
    def total(self) -> int:
        return self.trainer_world + self.rollout_world

    def role_of(self, rank: int) -> str:
        return TRAINER if rank < self.trainer_world else ROLLOUT


@dataclass
class Role:
    name: str            # TRAINER or ROLLOUT
    rank: int            # within the role's own world (its default process group)
    size: int            # ranks of this role
    placement: Placement
    store: object        # the launcher's store, shared by both roles (torch.distributed.Store)
    bridge: BridgeLinks  # all ranks of both roles, of the current generation
    generation: int = 0  # of the rollout engines (a replaced engine starts a new one)

    @property
    def first_rollout_rank(self) -> int:
        return self.placement.trainer_world

    def join_bridge(self, generation: int) -> None:
        """Join the bridge of the engines' generation `generation` (collective over both roles)."""
        self.bridge = _bridge(self.store, generation, self.bridge.rank, self.placement)
        self.generation = generation


def launcher_rank(placement: Placement) -> int:
    """This process's global rank, checked against the placement."""
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    if launched != placement.total:
        raise ValueError(f"layout.world_size={placement.trainer_world} trainer ranks + "
                         f"layout.rollout_world_size={placement.rollout_world} rollout ranks need "
                         f"{placement.total} processes, but the launcher started {launched}: use torchrun "
                         f"--nproc-per-node {placement.total} (megarl's Ray launch places both roles itself)")
    return int(os.environ["RANK"])


def launcher_store(placement: Placement):
    """The launcher's store (torchrun's agent store, or the one global rank 0 serves)."""
    if dist.is_initialized():
        raise RuntimeError("torch.distributed is already started in this process; disaggregated "
                           "placement must start each role's world itself")
    store, _, _ = next(dist.rendezvous("env://", timeout=datetime.timedelta(seconds=placement.timeout_s)))
    return store


def _bridge(store, generation: int, rank: int, placement: Placement) -> BridgeLinks:
    return BridgeLinks.start(f"megarl/bridge/{generation}", store, rank, placement.total,
                             datetime.timedelta(seconds=placement.timeout_s))


def start(placement: Placement, store, generation: int = 0) -> Role:
    """Start this process's role world and join the bridge of `generation`. A trainer rank calls
    it once; an engine process once per generation (its world is named by the generation, so a
    replacement never meets its predecessor's). Collective over the role, then over both roles."""
    rank = int(os.environ.get("MEGARL_BRIDGE_RANK", os.environ["RANK"]))
    name = placement.role_of(rank)
    role_rank = rank if name == TRAINER else rank - placement.trainer_world
    role_size = placement.trainer_world if name == TRAINER else placement.rollout_world
    if device_choice.on_gpu():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    world_name = TRAINER if name == TRAINER else f"{ROLLOUT}/{generation}"
    dist.init_process_group(backend=megatron_groups.backend(),
                            store=dist.PrefixStore(f"megarl/{world_name}", store), rank=role_rank,
                            world_size=role_size, timeout=datetime.timedelta(seconds=placement.timeout_s))
    # vLLM's external launcher and every RANK reader see the role's own world from here on.
    os.environ.update(RANK=str(role_rank), WORLD_SIZE=str(role_size), MEGARL_BRIDGE_RANK=str(rank))
    return Role(name, role_rank, role_size, placement, store, _bridge(store, generation, rank, placement),
                generation)
