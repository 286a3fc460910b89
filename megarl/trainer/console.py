"""What a run shows on the terminal, and where everything else goes.

The terminal gets megarl's own lines (`say`), one progress bar (rank 0's steps) and errors.
Everything else a process writes (vLLM, Megatron, torch and Ray, from Python and C++ alike) goes
to run_dir/logs/<name>.log: `output` points file descriptors 1 and 2 at that file and keeps the
terminal's descriptors for megarl's lines. Under Ray, rank 0 sends its lines and progress to the
driver through a Ray queue and the driver draws them (launch.py: the workers' own output is not
forwarded). With `verbose` nothing moves: every process writes where it always did.
Does not own what is said (the loop, metrics.py) nor where processes start (launch.py, the script).
"""

import contextlib
import os
import sys
import warnings
from typing import Iterable, TextIO


class Terminal:
    """megarl's lines on `out` and the step bar on `err`: the streams a person watches."""

    def __init__(self, out, err):
        self.out, self.err, self.bar = out, err, None

    def say(self, text: str) -> None:
        if self.bar is not None:
            self.bar.clear()
            self.err.flush()
        self.out.write(text + "\n")
        self.out.flush()
        if self.bar is not None:
            self.bar.refresh()

    def start_bar(self, total: int, done: int) -> None:
        from tqdm import tqdm

        self.bar = tqdm(total=total, initial=done, desc="steps", unit="step", file=self.err)

    def advance(self, postfix: dict) -> None:
        self.bar.set_postfix(postfix, refresh=False)
        self.bar.update(1)

    def end_bar(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.err.flush()  # tqdm leaves the closing newline unflushed
            self.bar = None


class Forward:
    """Rank 0 of a Ray run: its lines and progress go to the driver (a ray.util.queue.Queue),
    which draws them with `draw`."""

    def __init__(self, queue):
        self.queue = queue

    def say(self, text: str) -> None:
        self.queue.put(("say", (text,)))

    def start_bar(self, total: int, done: int) -> None:
        self.queue.put(("start_bar", (total, done)))

    def advance(self, postfix: dict) -> None:
        self.queue.put(("advance", (postfix,)))

    def end_bar(self) -> None:
        self.queue.put(("end_bar", ()))


_console = None  # this process's Terminal or Forward; a Terminal on sys.stdout/stderr until `output`
_echo = False  # inside `output`: megarl's lines also go to the log (fd 1)


def _current():
    global _console
    if _console is None:
        _console = Terminal(sys.stdout, sys.stderr)
    return _console


def say(text: str) -> None:
    """One megarl line: on the terminal (the driver's under Ray) and in this process's log."""
    if _echo:
        print(text, flush=True)
    _current().say(text)


def start_bar(total: int, done: int) -> None:
    """The step bar, `done` of `total` steps already behind (a resumed run)."""
    _current().start_bar(total, done)


def advance(**postfix: str) -> None:
    """One more step done; `postfix` shown after the bar (e.g. reward)."""
    _current().advance(postfix)


def end_bar() -> None:
    _current().end_bar()


def draw(events: Iterable[tuple]) -> None:
    """Draw here what another process's Forward sent (the Ray driver, for rank 0)."""
    for name, args in events:
        getattr(_current(), name)(*args)


def log_path(run_dir: str, name: str) -> str:
    return os.path.join(run_dir, "logs", f"{name}.log")


def _terminal_stream(fd: int, like) -> TextIO:
    return open(fd, "w", encoding=getattr(like, "encoding", None) or "utf-8", errors="replace",
                closefd=False)


@contextlib.contextmanager
def output(run_dir: str, name: str, verbose: bool, forward=None, early_warnings: Iterable = (),
           tell: bool = False):
    """Within: this process's fds 1 and 2 write to run_dir/logs/<name>.log, megarl's lines to the
    terminal (to `forward`, a Ray queue the driver draws from, when given). `early_warnings`
    (caught before run_dir could be made) are written to the log first; `tell` says on the
    terminal where the logs are. An error leaving the block is announced on the terminal with the
    log's path and propagates: once the streams are back, it prints whole there.
    `verbose`: nothing moves."""
    global _console, _echo
    if verbose:
        yield
        return
    path = log_path(run_dir, name)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)  # not inherited: child processes get the log only
    terminal = Terminal(_terminal_stream(saved[0], sys.stdout), _terminal_stream(saved[1], sys.stderr))
    with open(path, "a") as log:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
    _console, _echo = (Forward(forward) if forward is not None else terminal), True
    try:
        for w in early_warnings:
            warnings.showwarning(w.message, w.category, w.filename, w.lineno)
        if tell:
            say(f"megarl: full logs (vLLM, Megatron, torch, Ray) in {log_path(run_dir, 'rank0')}, "
                "one file per process there; --verbose prints them here instead")
        yield
    except BaseException as error:
        terminal.end_bar()
        terminal.say(f"megarl: {name} stopped ({type(error).__name__}); its full log: {path}")
        raise
    finally:
        terminal.end_bar()
        sys.stdout.flush()
        sys.stderr.flush()
        for target, fd, stream in zip((1, 2), saved, (terminal.out, terminal.err)):
            stream.close()  # flushes; the descriptor stays open (closefd=False)
            os.dup2(fd, target)
            os.close(fd)
        _console, _echo = None, False


def caught_warnings(verbose: bool) -> contextlib.AbstractContextManager:
    """Warnings held back (as a list) until `output` writes them to the log; `verbose`: shown."""
    return contextlib.nullcontext([]) if verbose else warnings.catch_warnings(record=True)
