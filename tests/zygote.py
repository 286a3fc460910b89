"""A process that has imported torch, Megatron-Core, vLLM and megarl once, and forks the processes
of tests/launch.run from that state: a launch here costs a fork instead of ~7 s of imports per
rank and ~3 s of torchrun (measured: tests/launch.py). Each rank then runs its script as `python
SCRIPT ARGS` would (runpy as __main__, sys.argv, sys.path[0] the script's folder, the launch's own
environment, its own stdout and stderr) and exits through the interpreter's normal shutdown.

Started by tests/launch.py as `python tests/zygote.py SOCKET`. One launch per connection: a
line of JSON {script, args, nproc, env, cwd, stdout, stderr} in; {"pid": launcher} back at once,
then {"returncode": rc} when the launch ends. The launcher (a fork in a session of its own, so
one killpg stops a launch) forks the ranks with torchrun's variables and, like torchrun, stops
the others when one fails and then exits 1, and holds the launch's TCPStore as torchrun's agent
does (TORCHELASTIC_USE_AGENT_STORE): ranks that outlive rank 0 still reach it.

What a fork cannot give: the interpreter's hash seed is the zygote's in every rank (torchrun's
ranks each draw their own), and libgomp read OMP_NUM_THREADS when the zygote loaded it (a rank
sets torch's thread count from its own OMP_NUM_THREADS instead). Launches that test the
launchers themselves (Slurm, Ray, kills) start fresh interpreters (tests/launch.py: FRESH)."""

import json
import os
import runpy
import signal
import socket
import sys
import time

from megarl.platform import heap

# torchrun's default for several ranks per node: one intra-op thread each.
TORCHRUN_THREADS = "1"
# After a rank fails, how long the others get after SIGTERM before SIGKILL (torchrun: 30 s).
STOP_GRACE_S = 10
# How long the agent store waits on a rank's request (torchrun's default store timeout).
STORE_TIMEOUT_S = 900


def preload() -> None:
    """The imports every launched script pays for. They start no Python thread and no pool (torch
    leaves one idle native thread, measured: /proc/self/task); a fork copies only the thread that
    calls it."""
    import torch  # noqa: F401
    import transformers  # noqa: F401
    import vllm  # noqa: F401

    import megarl.rollout.engine  # noqa: F401
    import megarl.trainer.loop  # noqa: F401

    # vllm imports LLM (and on a CPU its worker) only when an engine starts: ~3.5 s of one core in
    # every rank that starts one (measured after the imports above). LLM's imports load OpenCV, whose
    # OpenBLAS would start a pool of threads here: one thread instead (each rank runs in its launch's
    # environment, and none uses OpenCV's BLAS).
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    from vllm import LLM  # noqa: F401
    from vllm.platforms import current_platform  # resolved by LLM's imports already

    if current_platform.is_cpu():  # its modules patch torch.cuda for the CPU
        import vllm.v1.worker.cpu_worker  # noqa: F401

    # Every training run ends drawing its curves (megarl/trainer/plots.py, which picks Agg itself):
    # pyplot's import was ~0.9 s of a core in each, after the imports above. It starts no thread.
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot  # noqa: F401


def serve(path: str):
    """Accept launches until killed; returns only in a launcher's process: (connection, request)."""
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(64)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # launchers are reaped without a wait
    print("ready", flush=True)
    while True:
        connection, _ = server.accept()
        request = json.loads(connection.makefile("r").readline())
        if os.fork() == 0:
            server.close()
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            os.setsid()
            return connection, request
        connection.close()


def rank_env(request: dict, rank: int) -> dict:
    env = dict(request["env"])
    nproc = request["nproc"]
    if nproc > 1:
        env.setdefault("OMP_NUM_THREADS", TORCHRUN_THREADS)
        env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc),
                   LOCAL_WORLD_SIZE=str(nproc), GROUP_RANK="0", ROLE_RANK=str(rank),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(request["port"]),
                   TORCHELASTIC_USE_AGENT_STORE="True")
    return env


def launch(connection: socket.socket, request: dict):
    """Fork the ranks and supervise them; returns only in a rank's process: the env it runs with."""
    connection.sendall(json.dumps({"pid": os.getpid()}).encode() + b"\n")
    out = os.open(request["stdout"], os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    err = os.open(request["stderr"], os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    ranks = {}
    for rank in range(request["nproc"]):
        pid = os.fork()
        if pid == 0:
            connection.close()
            os.dup2(out, 1)
            os.dup2(err, 2)
            os.close(out)
            os.close(err)
            return rank_env(request, rank)
        ranks[pid] = rank
    store = agent_store(request)  # after the forks: its server runs a thread
    returncode = supervise(ranks, request["nproc"])
    del store
    connection.sendall(json.dumps({"returncode": returncode}).encode() + b"\n")
    os._exit(0)


def agent_store(request: dict):
    """The launch's TCPStore, held by the launcher as torchrun's agent holds it: a rank that outlives
    rank 0 (a rollout rank finishing its last draw) still reaches the store."""
    if request["nproc"] == 1:
        return None
    from datetime import timedelta

    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", request["port"], request["nproc"], is_master=True,
                         timeout=timedelta(seconds=STORE_TIMEOUT_S), wait_for_workers=False)


def supervise(ranks: dict, nproc: int) -> int:
    """Wait for every rank; the first failure stops the rest (SIGTERM, SIGKILL after the grace)."""
    failed, stop_at = None, None
    while ranks:
        pid, status = os.waitpid(-1, os.WNOHANG) if stop_at else os.wait()
        if pid == 0:
            if time.monotonic() > stop_at:
                for other in ranks:
                    os.kill(other, signal.SIGKILL)
            time.sleep(0.1)
            continue
        if ranks.pop(pid, None) is None:
            continue
        code = os.waitstatus_to_exitcode(status)
        if code != 0 and failed is None:
            failed, stop_at = code, time.monotonic() + STOP_GRACE_S
            for other in ranks:
                os.kill(other, signal.SIGTERM)
    if failed is None:
        return 0
    return 1 if nproc > 1 else failed


def become(env: dict, request: dict) -> None:
    """This process as `python SCRIPT ARGS` in the launch's environment would be."""
    os.environ.clear()
    os.environ.update(env)
    os.chdir(request["cwd"])
    script = request["script"]
    extra = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:] = [os.path.dirname(script), *extra, *sys.path[1:]]
    if "OMP_NUM_THREADS" in env:
        import torch

        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    sys.argv = [script, *request["args"]]


def main() -> None:
    preload()
    # vLLM collects garbage seven times in an engine's life, each a pass over every object the
    # imports made: ~0.3 s of a core each in a fork, and the pass writes to every page it touches,
    # so the fork copies them. Frozen here, the imports' objects are skipped: ~1.2 s of a core
    # less in a one-rank 2-step demo run; and a fork that exits frozen skips the interpreter's
    # last collections over them too, 0.5 CPU s against 3.4 unfrozen (docs/testing.md, "Where
    # the CPU goes"). A fork whose script starts no engine (an engine's shutdown unfreezes) exits
    # frozen: Triton's import-time objects are never freed, and nanobind reports them on stderr
    # (launch.without_leak_report).
    heap.freeze_heap()
    connection, request = serve(sys.argv[1])
    env = launch(connection, request)
    become(env, request)
    runpy.run_path(request["script"], run_name="__main__")


if __name__ == "__main__":
    main()
