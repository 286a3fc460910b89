"""Ray as the distributed engine: one worker per device slot, together one torch.distributed
world running megarl.trainer.loop.train.

The driver reserves world_size + rollout_world_size slots in a placement group (a CPU each here,
a GPU and a CPU each on a GPU cluster), packed, numbers the ranks node by node (placement.py: a
TP group or a rollout engine that would span two nodes is refused; with rollout ranks of their
own, the first world_size ranks train and the rest roll out), starts one worker per slot with the
torch.distributed environment (rank, world, local rank, master address and port) and the
driver's NCCL/device settings (worker_env.py; gloo's interface, unless given, chosen on each
node), and waits for all of them; each rank's log starts with its node and the settings it got.
`ray.init()` starts a local cluster when there is none; `ray_address` joins an existing one (e.g.
the one a Slurm job started).
Unless verbose, each worker writes its output to run_dir/logs/rank<R>.log and Ray forwards none of
it: rank 0's megarl lines and progress come through a queue and the driver draws them (console.py).
Does not own the loop (loop.py).
"""

import os
from typing import Optional, Tuple

from megarl.models.weights.destination import RolloutLayout
from megarl.planning.resolved import ResolvedRun
from megarl.trainer import console, placement
from megarl.trainer.worker_env import gloo_interface, node_interfaces, route_address, worker_env


class _Worker:
    def setup(self, rank: int, world: int, local_rank: int, local_world: int, master: str,
              port: int) -> None:
        # LOCAL_WORLD_SIZE as torchrun sets it: the weight sync reads the node of each rank from it.
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(local_rank),
                          LOCAL_WORLD_SIZE=str(local_world), MASTER_ADDR=master, MASTER_PORT=str(port))
        gloo = gloo_interface(os.environ, node_interfaces(), route_address(master))
        if gloo is not None:
            os.environ["GLOO_SOCKET_IFNAME"] = gloo

    def node(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()

    def address(self) -> Tuple[str, int]:
        """This node's IP and a port free on it: rank 0 serves torch.distributed's store, and
        with several nodes the driver's node need not be rank 0's."""
        import ray

        from megarl.parallel_state.megatron_groups import free_port

        return ray.util.get_node_ip_address(), free_port()

    def train(self, run: ResolvedRun, resume: Optional[str], verbose: bool, inbox) -> dict:
        """The loop, its output in this rank's log; megarl's lines to `inbox` (rank 0) if given."""
        import ray

        from megarl.trainer.loop import train

        rank = os.environ["RANK"]
        with console.output(run.config.run_dir, f"rank{rank}", verbose, forward=inbox):
            # Where this rank runs and the network settings it runs with: what a multi-node hang
            # is first checked against.
            settings = " ".join(f"{k}={v}" for k, v in sorted(worker_env(os.environ, gpus=False).items()))
            print(f"megarl: rank {rank} of {os.environ['WORLD_SIZE']} on Ray node {self.node()} "
                  f"({ray.util.get_node_ip_address()}), local rank {os.environ['LOCAL_RANK']} of "
                  f"{os.environ['LOCAL_WORLD_SIZE']}; settings: {settings or 'none'}", flush=True)
            return train(run, resume)


def _results(ray, refs: list, run_dir: str, inbox) -> dict:
    """Rank 0's result once every worker has finished, drawing what rank 0 sends to `inbox` (a
    queue, or None) meanwhile. The first worker to fail ends the run at once: the others would
    otherwise wait in a collective for it until the process-group timeout."""
    from megarl.trainer.checkpoint import complete_checkpoints

    pending = list(refs)
    while pending:
        done, pending = ray.wait(pending, num_returns=1, timeout=None if inbox is None else 0.25)
        if inbox is not None:
            console.draw(inbox.get_nowait_batch(inbox.qsize()))
        if not done:
            continue
        try:
            ray.get(done[0])
        except Exception as error:  # the worker raised (RayTaskError), or its process died
            cause = getattr(error, "cause", None) or error
            last_line = (str(cause).strip().splitlines() or [""])[-1]
            newest = (complete_checkpoints(run_dir) or ["none"])[-1]
            rank = refs.index(done[0])
            log = "" if inbox is None else f"; its full log: {console.log_path(run_dir, f'rank{rank}')}"
            raise RuntimeError(f"worker rank {rank} failed ({type(cause).__name__}: {last_line}); "
                               f"newest complete checkpoint: {newest}; continue with --resume auto"
                               f"{log}") from error
    return ray.get(refs[0])


def launch(run: ResolvedRun, ray_address: Optional[str] = None, resume: Optional[str] = None,
           verbose: bool = False) -> dict:
    """Run the resolved run's loop on layout.world_size Ray workers (plus layout.rollout_world_size
    rollout workers); returns rank 0's last metrics. `verbose`: every worker's output forwarded to
    this terminal, as Ray does by default."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.queue import Queue
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    config = run.config
    layout = config.layout
    world = layout.world_size + layout.rollout_world_size
    ray.init(address=ray_address, include_dashboard=False, log_to_driver=verbose)
    gpus = ray.cluster_resources().get("GPU", 0) > 0
    slot = {"CPU": 1, "GPU": 1} if gpus else {"CPU": 1}
    available = ray.cluster_resources().get("GPU" if gpus else "CPU", 0)
    if available < world:
        raise ValueError(f"layout.world_size={layout.world_size} + layout.rollout_world_size="
                         f"{layout.rollout_world_size} needs {world} {'GPUs' if gpus else 'CPUs'}; the Ray "
                         f"cluster has {available:g}. Lower them or add nodes.")
    group = placement_group([slot] * world, strategy="PACK")
    ray.get(group.ready())
    env = worker_env(os.environ, gpus)
    worker_cls = ray.remote(num_cpus=1, num_gpus=1 if gpus else 0)(_Worker)
    workers = [worker_cls.options(
        scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=i),
        runtime_env={"env_vars": env}).remote() for i in range(world)]
    try:
        nodes = ray.get([w.node.remote() for w in workers])
        order = placement.ranks_by_node(nodes)
        workers, nodes = [workers[i] for i in order], [nodes[i] for i in order]
        engine = {"rollout engine": RolloutLayout(layout.rollout_tp, layout.rollout_ep).size}
        trainers, rollouts = nodes[:layout.world_size], nodes[layout.world_size:]
        placement.check_groups_within_nodes(
            trainers, {"tensor-parallel group": layout.tp, **({} if layout.disaggregated else engine)})
        placement.check_groups_within_nodes(rollouts, engine)
        master, port = ray.get(workers[0].address.remote())
        local_ranks = [nodes[:rank].count(node) for rank, node in enumerate(nodes)]
        ray.get([w.setup.remote(rank, world, local_ranks[rank], nodes.count(nodes[rank]), master, port)
                 for rank, w in enumerate(workers)])
        # No CPU of its own: the placement group may hold every one.
        inbox = None if verbose else Queue(actor_options={"num_cpus": 0})
        refs = [w.train.remote(run, resume, verbose, inbox if rank == 0 else None)
                for rank, w in enumerate(workers)]
        return _results(ray, refs, config.run_dir, inbox)
    finally:
        for w in workers:
            ray.kill(w)
        remove_placement_group(group)
        ray.shutdown()
