"""The remote code sandbox (`generation.agent.sandbox: http`): megarl's SandboxFusion client against
a small real run_code server started here (it runs the code in the local sandbox), over real HTTP:
the request verl's sandbox_fusion utils send, the answers mapped to the tool's text, retries after
a 503, and a sandbox that is down or hangs failing the call with a visible error in seconds, in
this process and through the tool pool's worker processes."""

import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from megarl.plugins.worker_pool import WorkerPool
from megarl.rollout.agent.loop import AgentConfig
from megarl.rollout.agent.sandbox import Limits, run_local
from megarl.rollout.agent.tools import CodeSandbox, loaded_tools, python

LIMITS = Limits(cpu_s=2, wall_s=3)


class RunCode(BaseHTTPRequestHandler):
    """POST /run_code as SandboxFusion answers it; the server's `unavailable` first requests get a
    503, each request waits `hang_s` first, and `sandbox_error` answers SandboxError."""

    def do_POST(self):
        server = self.server
        request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        server.requests.append(request)
        time.sleep(server.hang_s)
        if self.path != "/run_code":
            return self._answer(404, {"detail": "Not Found"})
        if len(server.requests) <= server.unavailable:
            return self._answer(503, {"detail": "starting"})
        if server.sandbox_error:
            return self._answer(200, {"status": "SandboxError", "message": "no executor left",
                                      "run_result": None})
        ran = run_local(request["code"], Limits(wall_s=request["run_timeout"],
                                                memory_bytes=request["memory_limit_MB"] << 20))
        run = {"status": "TimeLimitExceeded" if ran.exit_code is None else "Finished",
               "return_code": ran.exit_code, "stdout": ran.stdout, "stderr": ran.stderr,
               "execution_time": 0.1}
        self._answer(200, {"status": "Success" if ran.exit_code == 0 else "Failed", "message": "",
                           "compile_result": None, "run_result": run, "files": {}})

    def _answer(self, code: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.fixture
def server():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), RunCode)
    httpd.daemon_threads = True
    httpd.requests, httpd.unavailable, httpd.hang_s, httpd.sandbox_error = [], 0, 0.0, False
    httpd.url = f"http://127.0.0.1:{httpd.server_address[1]}/run_code"
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield httpd
    httpd.shutdown()
    httpd.server_close()


def _remote(url: str, timeout_s: float = 10, retries: int = 0) -> CodeSandbox:
    return CodeSandbox("http", url, timeout_s, retries, LIMITS)


def test_the_server_runs_the_code_and_answers_as_the_tool_does(server):
    sandbox = _remote(server.url)
    assert python("print(6 * 7)", sandbox) == "42\n"
    assert server.requests == [{"code": "print(6 * 7)", "language": "python", "run_timeout": 3,
                                "compile_timeout": 3, "memory_limit_MB": 1024, "stdin": "", "files": {},
                                "fetch_files": []}]
    assert python("import sys\nprint('out')\nsys.exit(3)", sandbox) == "out\n\n(exit code 3)"
    assert python("import time\ntime.sleep(30)", sandbox) == "\n(stopped at the wall-clock limit of 3 s)"
    assert AgentConfig(sandbox="http", sandbox_url=server.url).code_sandbox == \
        CodeSandbox("http", server.url, 30.0, 1)


def test_a_503_is_retried(server):
    server.unavailable = 2
    assert python("print(1)", _remote(server.url, retries=2)) == "1\n"
    assert len(server.requests) == 3
    server.requests.clear()
    with pytest.raises(RuntimeError, match=r"did not answer: 2 attempts of 10 s each failed "
                                           r"\(HTTP 503; HTTP 503\)"):
        python("print(1)", _remote(server.url, retries=1))


def _closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_a_sandbox_that_is_down_fails_the_call_visibly_at_once():
    url = f"http://127.0.0.1:{_closed_port()}/run_code"
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=rf"the sandbox at {url} did not answer: 3 attempts of 10 s each "
                                           r"failed \(URLError: \[Errno 111\] Connection refused; "):
        python("print(1)", _remote(url, retries=2))
    assert time.monotonic() - start < 3  # the backoff alone: 0.2 + 0.4 s


def test_a_hanging_sandbox_fails_the_call_at_its_timeout(server):
    server.hang_s = 5
    start = time.monotonic()
    # the headers never come: each attempt ends at its timeout
    with pytest.raises(RuntimeError, match=r"2 attempts of 0.5 s each failed \(TimeoutError: timed out; "
                                           r"TimeoutError: timed out\)"):
        python("print(1)", _remote(server.url, timeout_s=0.5, retries=1))
    assert time.monotonic() - start < 3


def test_answers_that_are_not_a_run_fail_at_once(server):
    server.sandbox_error = True
    with pytest.raises(RuntimeError, match=r"could not run the code: status 'SandboxError', no "
                                           r"executor left"):
        python("print(1)", _remote(server.url, retries=3))
    assert len(server.requests) == 1  # not retried
    with pytest.raises(RuntimeError, match=r"answered HTTP 404"):
        python("print(1)", _remote(server.url.replace("/run_code", "/nothing"), retries=3))


def test_the_tool_pool_s_workers_call_the_remote_sandbox(server):
    """The sandbox travels with each job to the worker processes; a down one is a tool error."""
    pool = WorkerPool("megarl.rollout.agent.tool_worker", loaded_tools, 2, 30.0, ["python"])
    try:
        up, down = pool.map([
            ("python", ("tool", ({"code": "print(6 * 7)"}, _remote(server.url)))),
            ("python", ("tool", ({"code": "print(1)"}, _remote(f"http://127.0.0.1:{_closed_port()}/run_code"))))])
    finally:
        pool.close()
    assert up.value == "42\n" and server.requests[0]["code"] == "print(6 * 7)"
    assert down.value is None and not down.timed_out and "did not answer" in down.error, down
