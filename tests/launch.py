"""Start megarl scripts as users do (plain python for one rank, torchrun for several), their
processes forked from tests/zygote.py, which paid the imports once (MEGARL_TEST_FRESH=1: fresh
interpreters, python and torchrun themselves). spawn() begins one to be killed mid-run. Launches
that test the launchers (Slurm, Ray) start their processes with subprocess directly."""

import atexit
import concurrent.futures
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(script: str, *args: str, nproc: int = 1, timeout: int = 600,
        check: bool = True, env: dict = None) -> subprocess.CompletedProcess:
    path = os.path.join(ROOT, script)
    cmd = _command(path, args, nproc)
    env = {**os.environ, **(env or {})}
    if FRESH:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env)
    else:
        proc = _forked(cmd, path, args, nproc, timeout, env)
    if check and proc.returncode != 0:
        raise AssertionError(
            f"{' '.join(cmd)} exited {proc.returncode}\n--- stdout ---\n{proc.stdout[-3000:]}"
            f"\n--- stderr ---\n{proc.stderr[-6000:]}"
        )
    return proc


def _command(path: str, args, nproc: int) -> list:
    """How a user starts it: python for one rank, torchrun for several."""
    if nproc == 1:
        return [sys.executable, path, *args]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
            path, *args]


# MEGARL_TEST_FRESH=1: every launch a fresh interpreter (python, torchrun), as users start them.
# Otherwise run() forks them from tests/zygote.py, which paid the imports once.
FRESH = os.environ.get("MEGARL_TEST_FRESH") == "1"
_ZYGOTE = {}
_ZYGOTE_LOCK = threading.Lock()


def _zygote_socket() -> str:
    """The socket of this test session's zygote, started at the first launch."""
    with _ZYGOTE_LOCK:
        if not _ZYGOTE:
            folder = tempfile.mkdtemp(prefix="megarl-zygote-")
            path = os.path.join(folder, "socket")
            proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "tests", "zygote.py"), path],
                                    cwd=ROOT, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, text=True)
            if proc.stdout.readline().strip() != "ready":
                raise AssertionError(f"tests/zygote.py did not start: exit {proc.wait()}")
            atexit.register(proc.kill)
            _ZYGOTE.update(path=path, proc=proc)
        return _ZYGOTE["path"]


def _forked(cmd: list, path: str, args: tuple, nproc: int, timeout: int,
            env: dict) -> subprocess.CompletedProcess:
    """cmd's launch, its ranks forked by the zygote; what subprocess.run(cmd) would return."""
    from megarl.parallel_state.megatron_groups import free_port

    with tempfile.TemporaryDirectory(prefix="megarl-launch-") as folder:
        out, err = os.path.join(folder, "stdout"), os.path.join(folder, "stderr")
        request = dict(script=path, args=list(args), nproc=nproc, env=env, cwd=ROOT, stdout=out,
                       stderr=err, port=free_port() if nproc > 1 else None)
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as connection:
            connection.connect(_zygote_socket())
            connection.sendall(json.dumps(request).encode() + b"\n")
            replies = connection.makefile("r")
            launcher = json.loads(replies.readline())["pid"]
            connection.settimeout(timeout)
            try:
                line = replies.readline()
            except TimeoutError:
                os.killpg(launcher, signal.SIGKILL)
                raise subprocess.TimeoutExpired(cmd, timeout) from None
            if not line:
                raise AssertionError(f"the zygote's launcher of {' '.join(cmd)} died")
        with open(out) as stdout, open(err) as stderr:
            return subprocess.CompletedProcess(cmd, json.loads(line)["returncode"], stdout.read(),
                                               stderr.read())


class Spawned:
    """A launch begun and not waited for (spawn), to be killed mid-run: kill() is SIGKILL of every
    process of the launch at once, as a node failure or the OOM killer would."""

    def __init__(self, proc: subprocess.Popen = None, connection: socket.socket = None, launcher: int = 0):
        self.proc, self.connection, self.launcher = proc, connection, launcher
        self.returncode = None

    def poll(self):
        if self.proc is not None:
            return self.proc.poll()
        if self.returncode is None:
            self.connection.setblocking(False)
            try:
                line = self.connection.recv(4096)
            except BlockingIOError:
                return None
            # the launcher's {"returncode": rc}, or nothing: it was killed
            self.returncode = json.loads(line)["returncode"] if line else -signal.SIGKILL
            self.connection.close()
        return self.returncode

    def kill(self) -> None:
        if self.proc is not None:
            kill_tree(self.proc)
            return
        try:
            os.killpg(self.launcher, signal.SIGKILL)  # the launcher's session: it and its ranks
        except ProcessLookupError:
            pass
        self.connection.close()
        self.returncode = -signal.SIGKILL


def spawn(script: str, *args: str, nproc: int = 1, env: dict = None) -> Spawned:
    """`script` launched as run() launches it (output discarded), returned at once."""
    path = os.path.join(ROOT, script)
    env = {**os.environ, **(env or {})}
    if FRESH:
        return Spawned(proc=subprocess.Popen(_command(path, args, nproc), cwd=ROOT, env=env,
                                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    from megarl.parallel_state.megatron_groups import free_port

    request = dict(script=path, args=list(args), nproc=nproc, env=env, cwd=ROOT, stdout=os.devnull,
                   stderr=os.devnull, port=free_port() if nproc > 1 else None)
    connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    connection.connect(_zygote_socket())
    connection.sendall(json.dumps(request).encode() + b"\n")
    reply = b""
    while not reply.endswith(b"\n"):
        reply += connection.recv(1)
    return Spawned(connection=connection, launcher=json.loads(reply)["pid"])


# What start() and in_background() began runs in these threads (each mostly waits on a process).
_STARTED = concurrent.futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="launch")


def in_background(call, *args, **kwargs) -> concurrent.futures.Future:
    """call(*args, **kwargs) begun now in a thread; .result() waits and returns (or raises) what it
    would. For launches that need nothing from the ones beside them: a one-rank launch leaves one
    of the 2 cores idle, and a waiting rank the CPU, so two launches together take less time than
    one after the other."""
    return _STARTED.submit(call, *args, **kwargs)


def start(script: str, *args: str, **kwargs) -> concurrent.futures.Future:
    """run() begun now in the background (in_background)."""
    return in_background(run, script, *args, **kwargs)


def two_at_a_time(calls: dict) -> dict:
    """{name: Future} of `calls` ({name: a function of no arguments}) run two at a time in their
    order (list the longest first), all ended when this returns; .result() gives what each
    returned or raises what it raised, so a failed launch fails its own test. For one-rank
    launches: vLLM gives a one-rank run one torch thread, so two of them side by side share the 2
    cores (each took about 1.45x its time alone here, so a pair ends sooner than the two in turn);
    launches of more ranks slow each other down instead."""
    with concurrent.futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="pair") as pool:
        return {name: pool.submit(call) for name, call in calls.items()}


def one_rank_env() -> dict:
    """A world of one without torchrun (the script runs the loop in its own process), on a port of
    its own so that two such runs can be side by side."""
    from megarl.parallel_state.megatron_groups import free_port

    return {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(free_port())}


def by_layout(script: str, layouts: dict, case_of, root: str, worlds, extra=lambda world: ()):
    """for_layout(layout) -> {model: what the worker saved to ROOT/LAYOUT/MODEL.pt}, from one launch
    of `script` per world size in `worlds`, all begun now (a one-rank launch leaves a core idle).
    `layouts`: {name: (world size, ParallelDims fields, models)}; `case_of(model)`: the worker's
    case row; `extra(world)`: more arguments. A failed launch fails only its own layouts' cases."""
    import functools

    import torch

    mine = {world: [[layout, fields, [case_of(m) for m in models]]
                    for layout, (size, fields, models) in layouts.items() if size == world]
            for world in worlds}
    launches = {world: start(script, "--layouts", json.dumps(cases), "--out-dir", str(root), *extra(world),
                             nproc=world, timeout=900) for world, cases in mine.items()}
    concurrent.futures.wait(launches.values())

    @functools.lru_cache(maxsize=None)
    def for_layout(layout):
        world, _, models = layouts[layout]
        launches[world].result()
        return {m: torch.load(os.path.join(root, layout, f"{m}.pt")) for m in models}

    return for_layout


def finish(*started: concurrent.futures.Future) -> list:
    """What each started launch returned, in order; all are waited for before a failure is raised
    (none keeps running into the next test)."""
    concurrent.futures.wait(started)
    return [launch.result() for launch in started]


def load_script(name: str):
    """scripts/NAME.py loaded as a module, to call its functions in this process: launching a
    script costs ~4 s of imports here."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "scripts", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def without_leak_report(stderr: str) -> str:
    """`stderr` without the report of leaked objects nanobind (Triton's bindings) prints at the exit
    of a process forked from the zygote that started no engine: the zygote's heap stays frozen
    (tests/zygote.py), so Triton's import-time objects are never freed. A user's driver never
    freezes (megarl/platform/heap.py: the engine's processes do)."""
    report = ("nanobind: ", " - leaked ", " - ... skipped remainder", "See https://nanobind.readthedocs.io/")
    return "\n".join(line for line in stderr.split("\n") if not line.startswith(report))


def last_json(proc: subprocess.CompletedProcess) -> dict:
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if not lines:
        raise AssertionError(f"no JSON line in output:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1])


def ray_pids() -> set:
    """Process ids of Ray's live daemons and workers on this machine (zombies are dead: they wait
    for a parent that reaps, which a container's PID 1 may never do)."""
    import psutil

    found = set()
    for process in psutil.process_iter(["cmdline", "name", "status"]):
        text = " ".join(process.info["cmdline"] or [process.info["name"] or ""])
        if process.info["status"] != psutil.STATUS_ZOMBIE and any(
                key in text for key in ("raylet", "gcs_server", "ray::")):
            found.add(process.pid)
    return found


def kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL a launcher and every process under it at once, as a node failure or the OOM killer
    would. torchrun starts each rank in a session of its own, so killing torchrun's process
    group would leave the ranks running."""
    import psutil

    parent = psutil.Process(proc.pid)
    for process in [*parent.children(recursive=True), parent]:
        try:
            process.kill()
        except psutil.NoSuchProcess:
            pass
    proc.wait()
