"""The local code sandbox, tried as a red team would (issue 54): each attempt is a program the model
could write to read the run's files, write or delete outside its folder, see or signal the
trainer, reach the network, exhaust the machine or leave a process behind. Inside the sandbox each
fails and the host is as it was; the same program run as a plain subprocess (the isolation
switched off) succeeds, so every attempt is real. The sandbox still runs real programs (a numeric
computation checked against this process, the standard library, 1 MiB of output), and the tool
pool's kill of a call that outlives its timeout takes its sandbox with it."""

import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from typing import Callable, Optional

import pytest

from megarl.plugins.worker_pool import WorkerPool
from megarl.rollout.agent.loop import AgentConfig, load_tools
from megarl.rollout.agent.sandbox import Limits, Ran, check_local, run_local
from megarl.rollout.agent.tools import LOCAL, _apply, loaded_tools, python, schema_of

# Small limits keep the bombs to seconds: each is asked for twice what its limit allows.
LIMITS = Limits(cpu_s=1, wall_s=6, memory_bytes=256 << 20, file_bytes=4 << 20, disk_bytes=8 << 20,
                threads=16, open_files=64)
MARK = f"megarl-redteam-{uuid.uuid4().hex[:12]}"  # in every program: a process left over shows it
SECRET = f"secret-{uuid.uuid4().hex}"
ESCAPED = "ESCAPED"  # what a program prints when its attempt worked, as it sees it


@pytest.fixture(scope="module", autouse=True)
def sandbox_works():
    """make install sets bubblewrap up: a machine where it cannot work fails here, named."""
    try:
        check_local()
    except RuntimeError as error:
        pytest.fail(str(error))


def _leftovers() -> list:
    """Host processes whose command line holds MARK (the programs' own, and what they started)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if MARK.encode() in f.read():
                    found.append(int(pid))
        except OSError:
            pass
    return found


def _gone_soon() -> list:
    """MARK's processes still there after a second (an exiting process may be reaped a moment late)."""
    deadline = time.monotonic() + 1
    while _leftovers() and time.monotonic() < deadline:
        time.sleep(0.05)
    return _leftovers()


def inside(code: str, limits: Limits = LIMITS) -> Ran:
    ran = run_local(f"# {MARK}\n{code}", limits)
    assert _gone_soon() == [], "a process of the call outlived it"
    return ran


def outside(code: str, cwd: str) -> str:
    """The same program with the isolation switched off: a plain subprocess of this process."""
    proc = subprocess.run([sys.executable, "-c", f"# {MARK}\n{code}"], cwd=cwd, capture_output=True,
                          text=True, timeout=60)
    return proc.stdout + proc.stderr


@dataclass
class Host:
    """What a program might reach: a run folder with its held-out answers, a file in the home
    folder, a file to delete, the trainer (this process) and a stand-in it may signal, listeners."""
    tmp: str
    run_dir: str
    heldout: str
    home_file: str
    victim_file: str
    victim: subprocess.Popen
    tcp: socket.socket
    udp: socket.socket
    lan_ip: Optional[str]  # this machine's address on its network (outside the sandbox's)

    def received_tcp(self) -> bytes:
        self.tcp.settimeout(0.5)
        try:
            connection, _ = self.tcp.accept()
        except socket.timeout:
            return b""
        with connection:
            connection.settimeout(5)
            return connection.recv(64)

    def received_udp(self) -> bytes:
        self.udp.settimeout(0.5)
        try:
            return self.udp.recv(64)
        except socket.timeout:
            return b""


def _lan_ip() -> Optional[str]:
    """The address this machine sends from to another network (None without a route out)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("203.0.113.1", 9))  # TEST-NET-3: nothing is sent, a route is chosen
        except OSError:
            return None
        address = probe.getsockname()[0]
    return None if address.startswith("127.") else address


@pytest.fixture
def host(tmp_path):
    run_dir = tmp_path / "runs" / "demo_inputs"
    run_dir.mkdir(parents=True)
    heldout = run_dir / "heldout.jsonl"
    heldout.write_text(f'{{"prompt": "1 + 1", "answer": "{SECRET}"}}\n')
    victim_file = tmp_path / "checkpoint.pt"
    victim_file.write_text(SECRET)
    home_file = os.path.join(os.path.expanduser("~"), f".{MARK}-{uuid.uuid4().hex[:6]}")
    with open(home_file, "w") as f:
        f.write(SECRET)
    victim = subprocess.Popen(["sleep", "120"])  # a stand-in trainer process, safe to kill
    tcp = socket.create_server(("0.0.0.0", 0))
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    udp.bind(("0.0.0.0", 0))
    try:
        yield Host(str(tmp_path), str(tmp_path / "runs"), str(heldout), home_file, str(victim_file), victim,
                   tcp, udp, _lan_ip())
    finally:
        os.remove(home_file)
        victim.kill()
        victim.wait()
        tcp.close()
        udp.close()
        for pid in _leftovers():
            os.kill(pid, signal.SIGKILL)


def _plain_folder(host: Host) -> str:
    """The plain subprocess's working folder: a fresh temporary folder, as the sandbox's /tmp is."""
    folder = os.path.join(host.tmp, f"work-{uuid.uuid4().hex[:6]}")
    os.mkdir(folder)
    return folder


def _said(h: Host, out: str) -> bool:
    return ESCAPED in out


def _killed(process: subprocess.Popen) -> bool:
    try:
        process.wait(timeout=0.5)
    except subprocess.TimeoutExpired:
        return False
    return True


@dataclass
class Attempt:
    code: Callable[[Host], str]  # the program, given where the host's things are
    # whether it worked: seen on the host after the program, or in what it printed
    happened: Callable[[Host, str], bool] = _said
    stopped: Callable[[Ran], bool] = lambda ran: True  # inside: what stopped it, as its answer says
    root_only: bool = False  # the plain run succeeds only as root (another user's file, ptrace)


def _read(path_of: Callable[[Host], str]) -> Attempt:
    return Attempt(lambda h: f"print({ESCAPED!r}, open({path_of(h)!r}).read())",
                   lambda h, out: SECRET in out, lambda ran: "FileNotFoundError" in ran.stderr)


ATTEMPTS = {
    "read_heldout_answers": _read(lambda h: h.heldout),
    "read_home_folder": _read(lambda h: h.home_file),
    "read_another_users_file": Attempt(
        lambda h: f"print({ESCAPED!r}, len(open('/etc/shadow').read()))", root_only=True),
    "read_trainer_environ": Attempt(
        lambda h: f"print({ESCAPED!r}, open('/proc/{os.getpid()}/environ').read().count('PATH='))"),
    "read_parent_environment": Attempt(
        lambda h: f"import os\nif os.environ.get('MEGARL_REDTEAM') == {SECRET!r}: print({ESCAPED!r})"),
    "write_into_run_dir": Attempt(
        lambda h: f"open({os.path.join(h.run_dir, 'planted')!r}, 'w').write('x')",
        lambda h, out: os.path.exists(os.path.join(h.run_dir, "planted"))),
    "delete_checkpoint": Attempt(
        lambda h: f"import os\nos.remove({h.victim_file!r})",
        lambda h, out: not os.path.exists(h.victim_file)),
    "symlink_out_of_temp_folder": Attempt(
        lambda h: f"import os\nos.symlink({h.heldout!r}, 'link')\nprint(open('link').read())",
        lambda h, out: SECRET in out),
    "walk_up_out_of_temp_folder": Attempt(
        lambda h: f"import os\nprint(open(os.path.join(*['..'] * 40, {h.heldout[1:]!r})).read())",
        lambda h, out: SECRET in out),
    "list_trainer_processes": Attempt(
        lambda h: f"import os\nif '{os.getpid()}' in os.listdir('/proc'): print({ESCAPED!r})"),
    "signal_trainer": Attempt(
        lambda h: f"import os\nos.kill({os.getpid()}, 0)\nos.kill({h.victim.pid}, 9)",
        lambda h, out: _killed(h.victim), lambda ran: "ProcessLookupError" in ran.stderr),
    "ptrace_trainer": Attempt(
        lambda h: "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
                  f"if libc.ptrace(0x4206, {h.victim.pid}, 0, 0) == 0:\n"  # PTRACE_SEIZE: it runs on
                  f"    libc.ptrace(17, {h.victim.pid}, 0, 0)\n"  # PTRACE_DETACH
                  f"    print({ESCAPED!r})\n"
                  "else:\n    print('refused', ctypes.get_errno())",
        stopped=lambda ran: ran.stdout == "refused 3\n", root_only=True),  # ESRCH: no such process here
    "tcp_to_localhost": Attempt(
        lambda h: "import socket\n"
                  f"socket.create_connection(('127.0.0.1', {h.tcp.getsockname()[1]}), 2).sendall(b'{MARK}')",
        lambda h, out: h.received_tcp() == MARK.encode(), lambda ran: "ConnectionRefusedError" in ran.stderr),
    "udp_to_localhost": Attempt(  # sent into the sandbox's own loopback: the host hears nothing
        lambda h: "import socket\n"
                  f"socket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(b'{MARK}', ('127.0.0.1', "
                  f"{h.udp.getsockname()[1]}))",
        lambda h, out: h.received_udp() == MARK.encode()),
    "tcp_to_the_network": Attempt(
        lambda h: "import socket\n"
                  f"socket.create_connection(({h.lan_ip!r}, {h.tcp.getsockname()[1]}), 2).sendall(b'{MARK}')",
        lambda h, out: h.received_tcp() == MARK.encode(), lambda ran: "Network is unreachable" in ran.stderr),
    "udp_to_the_network": Attempt(
        lambda h: "import socket\n"
                  f"socket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(b'{MARK}', ({h.lan_ip!r}, "
                  f"{h.udp.getsockname()[1]}))",
        lambda h, out: h.received_udp() == MARK.encode(), lambda ran: "Network is unreachable" in ran.stderr),
    # 32 children, each alive for a second: a fork bomb's reach, bounded here. Inside, none is born.
    "fork_bomb": Attempt(
        lambda h: "import os, time\nborn = 0\n"
                  "for _ in range(32):\n"
                  "    try:\n        pid = os.fork()\n    except OSError:\n        break\n"
                  "    if pid == 0:\n        time.sleep(1)\n        os._exit(0)\n    born += 1\n"
                  f"print({ESCAPED!r} if born == 32 else born)\n"
                  "while True:\n    try:\n        os.wait()\n    except ChildProcessError:\n        break",
        stopped=lambda ran: ran.stdout == "0\n"),
    # Twice the thread limit, each alive for a second.
    "thread_bomb": Attempt(
        lambda h: "import threading, time\nstarted = []\n"
                  f"for _ in range({2 * LIMITS.threads}):\n"
                  "    try:\n        started.append(threading.Thread(target=time.sleep, args=(1,)))\n"
                  "        started[-1].start()\n"
                  "    except RuntimeError:\n        started.pop()\n        break\n"
                  f"print({ESCAPED!r} if len(started) == {2 * LIMITS.threads} else len(started))",
        stopped=lambda ran: 0 < int(ran.stdout) < LIMITS.threads),
    "memory_bomb": Attempt(
        lambda h: f"block = bytearray({2 * LIMITS.memory_bytes})\nprint({ESCAPED!r}, len(block))",
        stopped=lambda ran: "MemoryError" in ran.stderr),
    # Four processes of three quarters of the memory limit each: a memory bomb past a per-process
    # limit. Inside, no child is born to hold its share.
    "memory_bomb_in_many_processes": Attempt(
        lambda h: "import os, time\nheld = 0\n"
                  "for _ in range(4):\n"
                  "    read, write = os.pipe()\n"
                  "    try:\n        pid = os.fork()\n    except OSError:\n        break\n"
                  "    if pid == 0:\n"
                  f"        block = bytearray({3 * LIMITS.memory_bytes // 4})\n"
                  "        os.write(write, b'x')\n        time.sleep(1)\n        os._exit(0)\n"
                  "    held += len(os.read(read, 1))\n"
                  f"print({ESCAPED!r} if held == 4 else held)\n"
                  "while True:\n    try:\n        os.wait()\n    except ChildProcessError:\n        break",
        stopped=lambda ran: ran.stdout == "0\n"),
    "disk_fill": Attempt(  # many files, each under the file size limit: the folder's quota stops it
        lambda h: f"for i in range({2 * LIMITS.disk_bytes >> 20}):\n"
                  "    open(f'fill{i}', 'wb').write(bytes(1 << 20))\n"
                  f"print({ESCAPED!r})",
        stopped=lambda ran: "No space left on device" in ran.stderr),
    "one_huge_file": Attempt(
        lambda h: f"open('huge', 'wb').write(bytes({2 * LIMITS.file_bytes}))\nprint({ESCAPED!r})",
        stopped=lambda ran: "File too large" in ran.stderr),  # Python ignores SIGXFSZ: EFBIG
    "cpu_bomb": Attempt(  # half a second of CPU past the limit, then it says so
        lambda h: f"import time\nend = time.process_time() + {LIMITS.cpu_s + 0.5}\n"
                  f"while time.process_time() < end:\n    pass\nprint({ESCAPED!r})",
        stopped=lambda ran: "past the CPU limit" in ran.text(LIMITS)),
    # A daemon (a session of its own, its output let go) sleeping past the call: MARK in its command
    # line shows it.
    "process_left_running": Attempt(
        lambda h: "import os, time\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
                  "        null = os.open(os.devnull, os.O_RDWR)\n"
                  "        for fd in (0, 1, 2):\n            os.dup2(null, fd)\n"
                  "        time.sleep(60)\n    os._exit(0)\n"
                  "os.wait()",
        lambda h, out: bool(_leftovers())),
}


@pytest.mark.parametrize("name", sorted(ATTEMPTS))
def test_each_attempt_fails_inside_and_succeeds_outside(name, host, monkeypatch):
    attempt = ATTEMPTS[name]
    if name.endswith("to_the_network") and host.lan_ip is None:
        pytest.skip("this machine has no address on a network to try")
    monkeypatch.setenv("MEGARL_REDTEAM", SECRET)  # the trainer's environment, for the program to look for
    code = attempt.code(host)
    ran = inside(code)
    out = ran.stdout + ran.stderr
    assert not attempt.happened(host, out) and ESCAPED not in out, (name, ran)
    assert attempt.stopped(ran), (name, ran)
    assert host.victim.poll() is None and os.path.exists(host.victim_file), name  # the host as it was
    assert not os.path.exists(os.path.join(host.run_dir, "planted")), name
    if attempt.root_only and os.geteuid() != 0:
        pytest.skip("the plain run of this attempt needs root (as CI runs) to succeed")
    plain = outside(code, _plain_folder(host))
    assert attempt.happened(host, plain), (name, plain)


def test_an_unbounded_fork_bomb_ends_with_the_call():
    """A program spinning on fork (never to be run outside a sandbox): it gets no child and ends at
    its CPU limit, or the call's wall clock on a busy machine, with the call."""
    start = time.monotonic()
    limits = Limits(cpu_s=1, wall_s=4)
    bomb = inside("import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass",
                  limits)
    assert bomb.exit_code in (None, 128 + signal.SIGXCPU) and time.monotonic() - start < 10, bomb
    assert "past the CPU limit" in bomb.text(limits) or "stopped at the wall-clock limit" in bomb.text(limits)
    assert subprocess.run(["true"]).returncode == 0  # the host still starts processes


def test_what_the_program_sees():
    """Its own PID namespace, no privileges, an empty environment, a read-only tree but /tmp."""
    ran = inside("import os\n"
                 "status = dict(line.split(':', 1) for line in open('/proc/self/status'))\n"
                 "print(os.getpid(), sorted(p for p in os.listdir('/proc') if p.isdigit()))\n"
                 "print(status['NoNewPrivs'].strip(), status['CapEff'].strip(), os.getuid() != 0)\n"
                 "print(sorted(os.environ), os.getcwd(), sorted(os.listdir('/')))\n"
                 "try:\n    open('/planted', 'w')\nexcept OSError as e:\n    print(e.strerror)\n")
    pid_line, privileges, environment, root = ran.stdout.splitlines()
    assert pid_line == "2 ['1', '2']", ran  # bwrap's init and the program, nothing of the host
    assert privileges == "1 0000000000000000 True", ran
    assert environment.startswith("['HOME', 'LANG'") and "MEGARL" not in environment and "/tmp" in environment
    assert root == "Read-only file system", ran


def test_real_programs_still_run():
    primes = "print(sum(n for n in range(2, 100000) if all(n % d for d in range(2, int(n ** 0.5) + 1))))"
    expected = sum(n for n in range(2, 100000) if all(n % d for d in range(2, int(n ** 0.5) + 1)))
    assert python(primes) == f"{expected}\n"
    stdlib = ("import json, math, fractions, decimal, re, itertools, collections, statistics, hashlib, "
              "sqlite3, zlib, datetime, random, heapq, ctypes, ssl\n"
              "print(json.dumps([math.comb(10, 3), str(fractions.Fraction(1, 3) * 3), "
              "hashlib.sha256(b'x').hexdigest()[:8], "
              "sqlite3.connect(':memory:').execute('select 6*7').fetchone()[0]]))")
    assert python(stdlib) == '[120, "1", "2d711642", 42]\n'
    mebibyte = python("import sys\nsys.stdout.write('x' * (1 << 20))")
    assert mebibyte == "x" * (1 << 20)
    assert python("print('π', end='')") == "π"
    assert "(exit code 3)" in python("raise SystemExit(3)")
    traceback = python("def f():\n    raise KeyError('k')\nf()")
    assert traceback.startswith("Traceback") and "KeyError: 'k'" in traceback and "_run" not in traceback
    cut = run_local("import sys\nsys.stdout.write('y' * (3 << 20))")
    assert cut.cut and len(cut.stdout) == 1 << 20 and "[output cut at 1048576 bytes" in cut.text(LIMITS)


def test_a_call_killed_by_the_pool_takes_its_sandbox_with_it():
    """The pool kills a worker whose call outlives tool_timeout_s: the program dies with it."""
    pool = WorkerPool("megarl.rollout.agent.tool_worker", loaded_tools, 1, 2.0, ["python"])
    try:
        assert pool.map([("python", ("tool", ({"code": "print(1)"}, LOCAL)))])[0].value == "1\n"
        code = f"# {MARK}\nimport time\ntime.sleep(60)"
        result = pool.map([("python", ("tool", ({"code": code}, LOCAL)))])[0]
        assert result.timed_out, result
        assert _gone_soon() == []
    finally:
        pool.close()


def test_tools_that_run_code_get_the_run_s_sandbox_not_the_model_s():
    def run_tests(code: str, sandbox) -> str:
        """Run the code with its tests."""
        return sandbox.run(code + "\nprint('tests passed')").text(sandbox.limits)

    run_tests.runs_code = True
    assert schema_of("m:run_tests", run_tests)["parameters"]["properties"] == {"code": {"type": "string"}}
    arguments = {"code": "print(6 * 7)", "sandbox": "the model's own"}
    assert _apply(run_tests, ("tool", (arguments, LOCAL))) == "42\ntests passed\n"
    assert _apply(python, ("tool", (arguments, LOCAL))) == "42\n"


def test_a_machine_without_bubblewrap_is_refused_at_start(monkeypatch, tmp_path):
    config = AgentConfig(tools=("calculator", "python"))
    assert [tool.runs_code for tool in load_tools(config)] == [False, True]
    monkeypatch.setenv("PATH", str(tmp_path))  # no bwrap on it
    with pytest.raises(RuntimeError, match=r"needs bubblewrap \(bwrap\), which is not installed: run `make "
                                           r"install` as root"):
        load_tools(config)
    # Tools that run no code, or code run elsewhere, need no local sandbox.
    assert len(load_tools(AgentConfig(tools=("calculator",)))) == 1
    load_tools(AgentConfig(tools=("python",), sandbox="http", sandbox_url="http://127.0.0.1:1/run_code"))


def test_the_sandbox_keys_are_checked():
    for kwargs, message in [({"sandbox": "docker"}, r"sandbox='docker'; choose one of \('local', 'http'\)"),
                            ({"sandbox": "http"}, r"sandbox=http needs sandbox_url"),
                            ({"sandbox_timeout_s": 10}, r"sandbox_timeout_s=10 must exceed the code's own "
                                                        r"limit of 20 s"),
                            ({"sandbox_retries": -1}, r"sandbox_retries=-1 be >= 0")]:
        with pytest.raises(ValueError, match=message):
            AgentConfig(**kwargs)


def test_code_too_long_for_one_argument_is_refused():
    with pytest.raises(ValueError, match="the code is 100001 characters; the sandbox takes up to 100000"):
        run_local("#" * 100_001)
