"""Reward functions run in worker processes, several samples at once, each within a timeout.

A worker is a plain `python -m megarl.rewards.worker` process (not a fork of the trainer, which
holds process groups and a device; not a multiprocessing spawn, which would import the training
script again), fed one job at a time over a pipe once it says it is ready. A job that runs past
`timeout_s` has its worker killed and replaced and scores as a timeout; a worker that dies fails
its job the same way. With
`workers=0` the functions run in this process, one after another, with no timeout (for a
debugger).
"""

import os
import subprocess
import sys
import time
from collections import deque
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import List, Optional, Sequence, Tuple

from megarl.rewards.functions import LoadedFunctions, Outcome, Request
from megarl.rewards.worker import READY

Job = Tuple[str, Request]  # (reward function name, what it scores)


@dataclass(frozen=True)
class Result:
    outcome: Optional[Outcome]  # None when the job failed
    error: Optional[str] = None  # why it failed
    timed_out: bool = False


class _Worker:
    def __init__(self, preload: Sequence[str]):
        job_read, job_write = os.pipe()
        result_read, result_write = os.pipe()
        # The worker finds what this process finds: the user's reward modules, tests' helpers.
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        self.process = subprocess.Popen([sys.executable, "-m", "megarl.rewards.worker", str(job_read),
                                         str(result_write), *preload], pass_fds=(job_read, result_write),
                                        env=env)
        os.close(job_read)
        os.close(result_write)
        self.jobs = Connection(job_write, readable=False)
        self.results = Connection(result_read, writable=False)
        self.ready = False  # imported: a job's timeout starts when it is sent
        self.index: Optional[int] = None  # the job it runs
        self.deadline = 0.0

    def start(self, index: int, job: Job, timeout_s: float) -> None:
        self.index, self.deadline = index, time.monotonic() + timeout_s
        self.jobs.send((index, *job))

    def stop(self) -> None:
        self.jobs.close()
        self.results.close()
        self.process.kill()
        self.process.wait()


class ScoringPool:
    """`preload`: the functions each worker loads before it takes jobs (others load at their first
    job, and their import then counts against that job's timeout)."""

    def __init__(self, workers: int, timeout_s: float, preload: Sequence[str] = ()):
        if workers < 0 or timeout_s <= 0:
            raise ValueError(f"reward workers={workers} must be >= 0 and timeout_s={timeout_s} > 0")
        self.timeout_s, self.preload = timeout_s, tuple(preload)
        self.workers = [_Worker(self.preload) for _ in range(workers)]
        self._here = LoadedFunctions()  # workers=0: the functions run in this process

    def map(self, jobs: Sequence[Job]) -> List[Result]:
        """One Result per job, in order."""
        if not self.workers:
            return [Result(*self._here.call(*job)) for job in jobs]
        results: List[Optional[Result]] = [None] * len(jobs)
        queue = deque(enumerate(jobs))
        while queue or any(w.index is not None for w in self.workers):
            for worker in self.workers:
                if worker.ready and worker.index is None and queue:
                    worker.start(*queue.popleft(), self.timeout_s)
            busy = [w for w in self.workers if w.index is not None]
            soonest = min((w.deadline for w in busy), default=time.monotonic() + self.timeout_s)
            listening = [w for w in self.workers if w.index is not None or not w.ready]
            for conn in wait([w.results for w in listening], timeout=max(0.0, soonest - time.monotonic())):
                worker = next(w for w in listening if w.results is conn)
                try:
                    message = conn.recv()
                except EOFError:  # it died (killed, out of memory, os._exit in the function)
                    code = worker.process.wait()
                    if worker.index is None:
                        raise RuntimeError(f"a reward worker exited (code {code}) before it was ready; "
                                           "its output above says why") from None
                    results[worker.index] = Result(None, f"reward worker died (exit code {code})")
                    self._replace(worker)
                    continue
                if message == READY:
                    worker.ready = True
                    continue
                index, outcome, error = message
                results[index], worker.index = Result(outcome, error), None
            now = time.monotonic()
            for worker in [w for w in busy if w.index is not None and w.deadline <= now]:
                results[worker.index] = Result(None, f"timed out after {self.timeout_s:g} s", timed_out=True)
                self._replace(worker)
        return results

    def _replace(self, worker: _Worker) -> None:
        worker.stop()
        self.workers[self.workers.index(worker)] = _Worker(self.preload)

    def close(self) -> None:
        for worker in self.workers:
            worker.stop()
