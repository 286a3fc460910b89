"""Start megarl scripts the way users do: plain python for one rank, torchrun for several."""

import concurrent.futures
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(script: str, *args: str, nproc: int = 1, timeout: int = 600,
        check: bool = True, env: dict = None) -> subprocess.CompletedProcess:
    path = os.path.join(ROOT, script)
    if nproc == 1:
        cmd = [sys.executable, path, *args]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={nproc}", path, *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                          env={**os.environ, **(env or {})})
    if check and proc.returncode != 0:
        raise AssertionError(
            f"{' '.join(cmd)} exited {proc.returncode}\n--- stdout ---\n{proc.stdout[-3000:]}"
            f"\n--- stderr ---\n{proc.stderr[-6000:]}"
        )
    return proc


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
