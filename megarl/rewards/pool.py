"""The scoring pool: reward functions and judges run in `python -m megarl.rewards.worker`
processes, several samples at once, each within a timeout (megarl/plugins/worker_pool.py); a
Result's value is the function's Outcome."""

from typing import Sequence

from megarl.plugins.worker_pool import WorkerPool
from megarl.rewards.functions import loaded_functions


def scoring_pool(workers: int, timeout_s: float, preload: Sequence[str] = ()) -> WorkerPool:
    """Its jobs are (function name, Request)."""
    return WorkerPool("megarl.rewards.worker", loaded_functions, workers, timeout_s, preload)
