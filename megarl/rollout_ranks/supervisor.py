"""What a rollout rank's launcher process runs: it keeps this rank's engine process alive.

The engine (rollout_server.serve: vLLM, the rollout world, the bridge) runs in a child process.
When it dies (killed, crashed), its supervisor starts the engines' next generation (the store
counts generations: every rollout rank's supervisor replaces its own engine, since an engine of
several ranks cannot outlive one of them) and starts a new engine process in it. The trainers
see the new generation, join its bridge, publish where it starts (their data position) and push
their current weights to it; the steps whose rollouts were lost are generated again, with the
same prompts and seeds. After async.max_engine_restarts replacements the run ends, naming them.

Owns the engine processes' lifetime. Does not own what an engine does (rollout_ranks/server.py) or the
trainers' side of a replacement (disaggregated_rollouts.py).
"""

import multiprocessing
import time
from typing import Callable

from megarl.parallel_state import roles
from megarl.planning.resolved import ResolvedRun
from megarl.rollout_ranks.channel import RolloutChannel

POLL_S = 0.1


def _engine_process(run: ResolvedRun, placement: roles.Placement, generation: int) -> None:
    from megarl.rollout_ranks.server import serve

    store = roles.launcher_store(placement)
    serve(run, roles.start(placement, store, generation))


def _start_engine(run: ResolvedRun, placement: roles.Placement, generation: int, say: Callable[[str], None]):
    process = multiprocessing.get_context("spawn").Process(
        target=_engine_process, args=(run, placement, generation), name=f"megarl-engine-{generation}")
    process.start()
    say(f"megarl: rollout engine process {process.pid} (generation {generation}) started")
    return process


def supervise(run: ResolvedRun, placement: roles.Placement, say: Callable[[str], None]) -> None:
    """Run this rank's engine until the trainers stop the run; `say` tells the user of each
    engine process started or lost (the trainer's console)."""
    channel = RolloutChannel(roles.launcher_store(placement))
    limit = run.config.async_.max_engine_restarts
    generation = 0
    engine = _start_engine(run, placement, generation, say)
    while True:
        engine.join(timeout=POLL_S)
        exitcode = engine.exitcode  # read once: the process may end while this turn runs
        if exitcode == 0:
            return
        current = channel.generation()
        if exitcode is None and current == generation:
            continue
        if exitcode is not None and channel.stopping():
            raise RuntimeError(f"the rollout engine process {engine.pid} exited with {exitcode} after "
                               "the run was stopped: see this rank's log")
        if exitcode is not None and current == generation:
            say(f"megarl: rollout engine process {engine.pid} (generation {generation}) died "
                        f"(exit code {exitcode}); starting a new one")
            current = channel.next_generation(generation)
        if exitcode is None:  # another rollout rank's engine died: this one goes too
            engine.kill()
            engine.join()
        if current > limit:
            raise RuntimeError(f"rollout engines were replaced {current} times, more than "
                               f"async.max_engine_restarts={limit}; the newest exited with "
                               f"{engine.exitcode}: see this rank's log")
        generation = current
        time.sleep(POLL_S)
        engine = _start_engine(run, placement, generation, say)
