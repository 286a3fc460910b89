"""Users' functions run in worker processes, several jobs at once, each within a timeout: the
reward functions' scoring pool and the agent loop's tools.

A worker is a plain `python -m WORKER_MODULE` process (not a fork of the trainer, which holds
process groups and a device; not a multiprocessing spawn, which would import the training script
again), fed one job at a time over a pipe once it says it is ready. A job that runs past
`timeout_s` has its worker killed and replaced and fails as a timeout; a worker that dies fails
its job the same way. With `workers=0` the jobs run in this process, one after another, with no
timeout (for a debugger).

The worker module's main calls `serve` with a Caller: what loads a function by name and calls it
on a job's payload, returning (value, None) or (None, why it failed), never raising.
"""

import os
import subprocess
import sys
import time
from collections import deque
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any, Callable, Dict, List, Optional, Protocol, Sequence, Tuple

READY = "ready"
Job = Tuple[str, Any]  # (function name, its payload)


class Caller(Protocol):
    def call(self, name: str, payload: Any) -> Tuple[Any, Optional[str]]:
        """(the value, None) or (None, why it failed); payload None only loads the function."""


@dataclass(frozen=True)
class Result:
    value: Any  # None when the job failed
    error: Optional[str] = None  # why it failed
    timed_out: bool = False


class Loaded:
    """A Caller over functions loaded by name at their first use (`load`), each job's payload
    handed to `apply(function, payload)`. A failure, loading included, is returned as its message,
    never raised: a user's function must not end the run."""

    def __init__(self, load: Callable[[str], Callable], apply: Callable[[Callable, Any], Any]):
        self.load, self.apply = load, apply
        self._loaded: Dict[str, Callable] = {}

    def call(self, name: str, payload: Any) -> Tuple[Any, Optional[str]]:
        try:
            if name not in self._loaded:
                self._loaded[name] = self.load(name)
            return (None if payload is None else self.apply(self._loaded[name], payload)), None
        except Exception as error:
            return None, f"{type(error).__name__}: {error}"


def serve(in_fd: int, out_fd: int, caller: Caller, preload: Sequence[str]) -> None:
    """A worker's life: load `preload`, say READY, then answer (index, name, payload) jobs with
    (index, value, error) until the parent closes the pipe (or dies)."""
    inbox, outbox = Connection(in_fd, writable=False), Connection(out_fd, readable=False)
    for name in preload:
        caller.call(name, None)  # a bad name fails each job that names it, counted there
    outbox.send(READY)
    while True:
        try:
            index, name, payload = inbox.recv()
        except EOFError:
            return
        outbox.send((index, *caller.call(name, payload)))


class _Worker:
    def __init__(self, module: str, preload: Sequence[str]):
        job_read, job_write = os.pipe()
        result_read, result_write = os.pipe()
        # The worker finds what this process finds: the user's modules, tests' helpers.
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        self.process = subprocess.Popen([sys.executable, "-m", module, str(job_read), str(result_write),
                                         *preload], pass_fds=(job_read, result_write), env=env)
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


class WorkerPool:
    """`module`: the worker's module (its main calls `serve`); `here`: the Caller of workers=0;
    `preload`: the functions each worker loads before it takes jobs (others load at their first
    job, and their import then counts against that job's timeout)."""

    def __init__(self, module: str, here: Callable[[], Caller], workers: int, timeout_s: float,
                 preload: Sequence[str] = ()):
        if workers < 0 or timeout_s <= 0:
            raise ValueError(f"workers={workers} must be >= 0 and timeout_s={timeout_s} > 0")
        self.module, self.timeout_s, self.preload = module, timeout_s, tuple(preload)
        self.workers = [_Worker(module, self.preload) for _ in range(workers)]
        self._here = here() if not workers else None
        self._queue: deque = deque()  # (id, job) not yet sent
        self._done: List[Tuple[int, Result]] = []
        self._submitted = 0

    def submit(self, job: Job) -> int:
        """Queue a job; its id, as `poll` reports it."""
        index, self._submitted = self._submitted, self._submitted + 1
        if self._here is not None:
            self._done.append((index, Result(*self._here.call(*job))))
        else:
            self._queue.append((index, job))
        return index

    def poll(self, timeout_s: float = 0.0) -> List[Tuple[int, Result]]:
        """The jobs finished since the last poll (waiting up to `timeout_s` for one)."""
        deadline = time.monotonic() + timeout_s
        while True:
            self._dispatch()
            busy = [w for w in self.workers if w.index is not None]
            listening = [w for w in self.workers if w.index is not None or not w.ready]
            if self._done or not listening:  # nothing to wait for (workers=0 finishes at submit)
                done, self._done = self._done, []
                return done
            now = time.monotonic()
            soonest = min([w.deadline for w in busy] + [deadline])
            for conn in wait([w.results for w in listening], timeout=max(0.0, soonest - now)):
                self._receive(next(w for w in listening if w.results is conn))
            now = time.monotonic()
            for worker in [w for w in busy if w.index is not None and w.deadline <= now]:
                self._done.append((worker.index, Result(None, f"timed out after {self.timeout_s:g} s",
                                                        timed_out=True)))
                self._replace(worker)
            if self._done or now >= deadline or not (self._queue or busy):
                done, self._done = self._done, []
                return done

    def map(self, jobs: Sequence[Job]) -> List[Result]:
        """One Result per job, in order."""
        ids = {self.submit(job): i for i, job in enumerate(jobs)}
        results: Dict[int, Result] = {}
        while len(results) < len(ids):
            for index, result in self.poll(self.timeout_s):
                results[ids[index]] = result
        return [results[i] for i in range(len(jobs))]

    def _dispatch(self) -> None:
        for worker in self.workers:
            if worker.ready and worker.index is None and self._queue:
                worker.start(*self._queue.popleft(), self.timeout_s)

    def _receive(self, worker: _Worker) -> None:
        try:
            message = worker.results.recv()
        except EOFError:  # it died (killed, out of memory, os._exit in the function)
            code = worker.process.wait()
            if worker.index is None:
                raise RuntimeError(f"a {self.module} worker exited (code {code}) before it was ready; "
                                   "its output above says why") from None
            self._done.append((worker.index, Result(None, f"worker died (exit code {code})")))
            self._replace(worker)
            return
        if message == READY:
            worker.ready = True
            self._dispatch()
            return
        index, value, error = message
        self._done.append((index, Result(value, error)))
        worker.index = None
        self._dispatch()

    def _replace(self, worker: _Worker) -> None:
        worker.stop()
        self.workers[self.workers.index(worker)] = _Worker(self.module, self.preload)

    def close(self) -> None:
        for worker in self.workers:
            worker.stop()
