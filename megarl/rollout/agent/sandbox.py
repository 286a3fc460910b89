"""The local sandbox: a Python program the model wrote, run on this machine in bubblewrap (bwrap)
so that it cannot reach the run (tools.py's `python` and every tool that declares it runs code).

What the program gets, by construction (each namespace and mount is bwrap's, set up before it
starts):
- files: the interpreter, its standard library and the system's shared libraries (/usr/lib*),
  read-only, at their own paths; a private /tmp of `disk_bytes` (a tmpfs: its working folder and
  HOME) that is gone with the call; the rest of the tree is an empty read-only root. No run
  folder, data, checkpoints, home, /etc, site-packages (`python -I -S`: the standard library only);
- processes: one, with up to `threads` threads (RLIMIT_NPROC, counted in its own user namespace),
  in a PID namespace of its own (it sees and can signal its own threads only; /proc is its own).
  A seccomp filter fails fork, vfork and clone without CLONE_THREAD (EAGAIN): a fork bomb gets no
  child, and the memory limit, per process, is the call's (without cgroups nothing bounds the sum
  over processes). There is nothing but Python to run anyway;
- no network (a network namespace with its own loopback only), no IPC or hostname of the host;
- limits per process on CPU seconds, address space, file size and open files; the call's wall
  clock (`wall_s`), after which everything in it is killed;
- no privileges: no capabilities, no_new_privs, no new user namespaces; a run as root runs the
  program as nobody (root is exempt from RLIMIT_NPROC), in a private mount namespace where the
  interpreter's folder is reachable by nobody even if it sits under /root;
- an environment of HOME and LANG only.
Nothing outlives the call: bwrap dies with its caller (--die-with-parent), its PID namespace ends
with its first process, and the call kills bwrap's process group when it returns.

The limits are set by the sandbox's first Python lines (`_launcher`), inside the sandbox's own
user namespace, before the program's code runs: hard limits it cannot raise; the seccomp filter
(`no_new_processes`) by bwrap, last before the interpreter starts. A machine where bwrap
is missing or cannot make namespaces is refused by `check_local` (naming what is missing and the
fix), never run with less isolation. Does not own which tools run code (tools.py) or the remote
sandbox (sandbox_http.py).
"""

import ctypes
import functools
import os
import platform
import selectors
import shutil
import signal
import stat
import struct
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Optional, Tuple

BWRAP = "bwrap"
NOBODY = 65534  # the uid and gid a root caller runs programs as
MAX_CODE_CHARS = 100_000  # the code travels as one argument (Linux takes up to 128 KiB)
_SYSTEM_LIBS = ("/usr/lib", "/usr/lib64", "/usr/lib32", "/usr/libx32")
_ROOT_LIBS = ("/lib", "/lib64", "/lib32", "/libx32")  # symlinks into /usr on merged-/usr systems


@dataclass(frozen=True)
class Limits:
    cpu_s: int = 10  # CPU seconds per process (RLIMIT_CPU: SIGXCPU)
    wall_s: float = 20.0  # the call's wall clock; then every process of the call is killed
    memory_bytes: int = 1 << 30  # address space per process (RLIMIT_AS: MemoryError)
    file_bytes: int = 16 << 20  # one file's size (RLIMIT_FSIZE: SIGXFSZ or EFBIG)
    disk_bytes: int = 64 << 20  # all files together: the private /tmp's size (ENOSPC)
    threads: int = 32  # threads at once, the main one too (RLIMIT_NPROC: EAGAIN); no other process
    open_files: int = 64  # RLIMIT_NOFILE
    output_bytes: int = 1 << 20  # kept of stdout and of stderr each; the rest is read and dropped


LIMITS = Limits()

# Exit codes of a program ended by a limit's signal (bwrap reports a signal as 128 + its number)
_SIGNALLED = {128 + signal.SIGXCPU: "past the CPU limit", 128 + signal.SIGXFSZ: "past the file size limit",
              128 + signal.SIGKILL: "killed"}


@dataclass(frozen=True)
class Ran:
    """What a program did: what it printed (each stream cut at the output limit) and its exit
    code (None: stopped at the wall-clock limit)."""
    stdout: str
    stderr: str
    exit_code: Optional[int]
    cut: bool = False  # a stream printed more than the output limit

    def text(self, limits: Limits) -> str:
        """What the tool answers: the output, then how it ended unless with exit code 0."""
        out = self.stdout + self.stderr
        if self.cut:
            out += f"\n[output cut at {limits.output_bytes} bytes a stream]"
        if self.exit_code is None:
            return f"{out}\n(stopped at the wall-clock limit of {limits.wall_s:g} s)"
        if self.exit_code:
            why = _SIGNALLED.get(self.exit_code)
            return f"{out}\n(exit code {self.exit_code}{': ' + why if why else ''})"
        return out


def _launcher(limits: Limits) -> str:
    """The sandbox's first code: the hard limits, then the program (argv[1]) as `python -c` runs
    it, in __main__, its traceback without this frame. The CPU limit's hard value is a second
    above the soft one, so that the program gets SIGXCPU (named in its answer) before SIGKILL."""
    rlimits = [("RLIMIT_CPU", limits.cpu_s, limits.cpu_s + 1),
               *((name, value, value) for name, value in (
                   ("RLIMIT_AS", limits.memory_bytes), ("RLIMIT_FSIZE", limits.file_bytes),
                   ("RLIMIT_NPROC", limits.threads), ("RLIMIT_NOFILE", limits.open_files),
                   ("RLIMIT_CORE", 0)))]
    return (
        "def _run():\n"
        "    import resource, sys\n"
        f"    for name, soft, hard in {rlimits!r}:\n"
        "        resource.setrlimit(getattr(resource, name), (soft, hard))\n"
        "    code = sys.argv.pop(1)\n"
        "    del globals()['_run']\n"
        "    try:\n"
        "        exec(compile(code, '<string>', 'exec'), globals())\n"
        "    except SystemExit:\n"
        "        raise\n"
        "    except BaseException as error:\n"
        "        error.__traceback__ = error.__traceback__.tb_next\n"
        "        sys.excepthook(type(error), error, error.__traceback__)\n"
        "        raise SystemExit(1)\n"
        "_run()\n")


@dataclass(frozen=True)
class _View:
    """What bwrap binds, found once per process: the interpreter's files and the libraries."""
    interpreter: str
    args: Tuple[str, ...]
    # root only: (the topmost folder nobody may not enter, a bound path below it)
    staged: Tuple[Tuple[str, str], ...]


def _python_paths() -> Tuple[str, Tuple[str, ...]]:
    """The base interpreter (a venv's python is a link to it) and the folders it runs from: its
    installation's prefix, or, for the system's Python under /usr, the binary and the standard
    library alone (/usr/lib is bound anyway)."""
    interpreter = os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable)
    prefix = os.path.realpath(sys.base_prefix)
    if prefix == "/usr":
        return interpreter, (interpreter, os.path.realpath(os.path.dirname(os.__file__)))
    inside = interpreter.startswith(prefix + os.sep)
    return interpreter, (prefix,) if inside else (prefix, interpreter)


def _blocker(path: str) -> Optional[str]:
    """The topmost folder above `path` that others may not enter (None: every one lets them)."""
    parts = path.split(os.sep)
    for end in range(2, len(parts)):
        folder = os.sep.join(parts[:end])
        if not os.stat(folder).st_mode & stat.S_IXOTH:
            return folder
    return None


@functools.lru_cache(maxsize=None)
def _view() -> _View:
    interpreter, paths = _python_paths()
    args = []
    for path in paths:
        args += ["--ro-bind", path, path]
    for path in _SYSTEM_LIBS:
        if os.path.isdir(path) and not os.path.islink(path):
            args += ["--ro-bind", path, path]
    for path in _ROOT_LIBS:
        if os.path.islink(path):
            args += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            args += ["--ro-bind", path, path]
    args += ["--ro-bind-try", "/etc/ld.so.cache", "/etc/ld.so.cache"]
    staged = []
    if os.geteuid() == 0:
        for path in paths:
            blocker = _blocker(path)
            if blocker is not None:
                staged.append((blocker, path))
    return _View(interpreter, tuple(args), tuple(staged))


# seccomp's classic BPF (linux/filter.h, linux/seccomp.h): a program over struct seccomp_data
# {int nr; u32 arch; u64 ip; u64 args[6]}
_LD_ABS, _JEQ, _JGE, _JSET, _RET = 0x20, 0x15, 0x35, 0x45, 0x06
_ALLOW, _ERRNO = 0x7FFF0000, 0x00050000
_CLONE_THREAD = 0x00010000
# machine -> (its AUDIT_ARCH, syscalls that make a process, clone, clone3, the first of another ABI)
_ARCHES = {"x86_64": (0xC000003E, (57, 58), 56, 435, 0x40000000),  # fork, vfork; x32 above
           "aarch64": (0xC00000B7, (), 220, 435, None)}


@functools.lru_cache(maxsize=None)
def no_new_processes() -> bytes:
    """The seccomp filter the program runs under: fork, vfork and clone without CLONE_THREAD fail
    with EAGAIN (as at a process limit of one), clone3 with ENOSYS (so that the C library makes its
    threads with clone), and every syscall of another ABI (i386 or x32 on x86_64) with ENOSYS."""
    machine = platform.machine()
    if machine not in _ARCHES:
        raise RuntimeError(f"the local code sandbox knows the syscalls of {sorted(_ARCHES)}, not "
                           f"{machine!r}; use generation.agent.sandbox=http")
    arch, forks, clone, clone3, other_abi = _ARCHES[machine]
    deny, enosys = _ERRNO | 11, _ERRNO | 38  # EAGAIN, ENOSYS
    # (code, k, the label when true, the label when false): jumps resolved below
    program = [(_LD_ABS, 4, None, None), (_JEQ, arch, None, "enosys"), (_LD_ABS, 0, None, None)]
    if other_abi is not None:
        program.append((_JGE, other_abi, "enosys", None))
    program += [(_JEQ, nr, "deny", None) for nr in forks]
    program += [(_JEQ, clone3, "enosys", None), (_JEQ, clone, None, "allow"),
                (_LD_ABS, 16, None, None), (_JSET, _CLONE_THREAD, "allow", "deny")]
    labels = {"allow": len(program), "deny": len(program) + 1, "enosys": len(program) + 2}
    program += [(_RET, _ALLOW, None, None), (_RET, deny, None, None), (_RET, enosys, None, None)]
    code = b""
    for at, (op, k, true, false) in enumerate(program):
        jump = [0 if label is None else labels[label] - at - 1 for label in (true, false)]
        code += struct.pack("=HBBI", op, *jump, k)
    return code


def _bwrap_args(limits: Limits) -> Tuple[str, ...]:
    return (
        "--unshare-all", "--unshare-user", "--disable-userns", "--die-with-parent", "--new-session",
        "--cap-drop", "ALL", "--hostname", "sandbox", *_view().args,
        "--proc", "/proc", "--dev", "/dev", "--size", str(limits.disk_bytes), "--tmpfs", "/tmp",
        "--remount-ro", "/dev", "--remount-ro", "/", "--chdir", "/tmp",
        "--clearenv", "--setenv", "HOME", "/tmp", "--setenv", "LANG", "C.UTF-8")


_CLONE_NEWNS, _MS_NOSUID, _MS_NODEV, _MS_BIND, _MS_REC, _MS_PRIVATE = \
    0x00020000, 0x2, 0x4, 0x1000, 0x4000, 0x40000


def _as_nobody(staged: Tuple[Tuple[str, str], ...]) -> None:
    """A root caller's child, between fork and exec: in a private mount namespace, each staged
    path is bound again below a small tmpfs over its blocker (so that nobody can reach it at its
    own path, and the host's tree is untouched); then the child becomes nobody, and bwrap runs as
    nobody."""
    if staged:
        libc = ctypes.CDLL(None, use_errno=True)

        def call(result: int, what: str) -> None:
            if result != 0:
                raise OSError(ctypes.get_errno(), f"{what}: {os.strerror(ctypes.get_errno())}")

        call(libc.unshare(_CLONE_NEWNS), "unshare(CLONE_NEWNS)")
        call(libc.mount(None, b"/", None, _MS_REC | _MS_PRIVATE, None), "mount --make-rprivate /")
        # opened in this namespace, before the tmpfs hides them: a bind from another namespace's
        # mount is refused
        fds = [os.open(path, os.O_PATH) for _, path in staged]
        covered = set()
        for (blocker, path), fd in zip(staged, fds):
            if blocker not in covered:
                call(libc.mount(b"tmpfs", blocker.encode(), b"tmpfs", _MS_NOSUID | _MS_NODEV,
                                b"mode=0755,size=64k"), f"mount tmpfs on {blocker}")
                covered.add(blocker)
            if os.path.isdir(f"/proc/self/fd/{fd}"):
                os.makedirs(path, 0o755, exist_ok=True)
            else:
                os.makedirs(os.path.dirname(path), 0o755, exist_ok=True)
                open(path, "x").close()
            call(libc.mount(f"/proc/self/fd/{fd}".encode(), path.encode(), None, _MS_BIND | _MS_REC, None),
                 f"mount --bind {path}")
    os.setgroups([])
    os.setresgid(NOBODY, NOBODY, NOBODY)
    os.setresuid(NOBODY, NOBODY, NOBODY)


def run_local(code: str, limits: Limits = LIMITS) -> Ran:
    """Run `code` in the local sandbox and return what it did."""
    if len(code) > MAX_CODE_CHARS:
        raise ValueError(f"the code is {len(code)} characters; the sandbox takes up to {MAX_CODE_CHARS}")
    if "\0" in code:
        raise ValueError("the code holds a NUL character, which no program text can")
    view = _view()
    seccomp, feed = os.pipe()  # the filter is 8 bytes an instruction: far under a pipe's buffer
    os.write(feed, no_new_processes())
    os.close(feed)
    argv = [BWRAP, *_bwrap_args(limits), "--seccomp", str(seccomp), "--", view.interpreter, "-I", "-S", "-c",
            _launcher(limits), code]
    root = os.geteuid() == 0
    try:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, start_new_session=True, pass_fds=(seccomp,),
                                preexec_fn=functools.partial(_as_nobody, view.staged) if root else None)
    finally:
        os.close(seccomp)
    try:
        stdout, stderr, cut, finished = _collect(proc, limits)
    finally:
        _end(proc)
    return Ran(stdout.decode(errors="replace"), stderr.decode(errors="replace"),
               proc.returncode if finished else None, cut)


def _collect(proc: subprocess.Popen, limits: Limits) -> Tuple[bytes, bytes, bool, bool]:
    """(stdout, stderr, cut, finished before the wall clock): reads both streams until bwrap has
    exited and they are closed, keeping up to the output limit of each."""
    deadline = time.monotonic() + limits.wall_s
    kept = {proc.stdout.fileno(): bytearray(), proc.stderr.fileno(): bytearray()}
    cut = False
    exited = os.pidfd_open(proc.pid)
    try:
        with selectors.DefaultSelector() as selector:
            for fd in (*kept, exited):
                selector.register(fd, selectors.EVENT_READ)
            while selector.get_map():
                left = deadline - time.monotonic()
                if left <= 0:
                    return bytes(kept[proc.stdout.fileno()]), bytes(kept[proc.stderr.fileno()]), cut, False
                for key, _ in selector.select(left):
                    if key.fd == exited:
                        # bwrap exited (a zombie until _end reaps it, so its group id is not reused):
                        # what is left of its group dies now, and the streams close
                        _kill_group(proc.pid)
                        selector.unregister(exited)
                        continue
                    chunk = os.read(key.fd, 1 << 16)
                    if not chunk:
                        selector.unregister(key.fd)
                        continue
                    room = limits.output_bytes - len(kept[key.fd])
                    kept[key.fd] += chunk[:max(room, 0)]
                    cut = cut or len(chunk) > room
    finally:
        os.close(exited)
    return bytes(kept[proc.stdout.fileno()]), bytes(kept[proc.stderr.fileno()]), cut, True


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _end(proc: subprocess.Popen) -> None:
    """Nothing of the call goes on: bwrap's group killed (its PID namespace ends with it), bwrap
    reaped, the pipes closed."""
    _kill_group(proc.pid)
    proc.wait()
    proc.stdout.close()
    proc.stderr.close()


def check_local() -> None:
    """Raise RuntimeError naming what this machine lacks for the local sandbox, and the fix."""
    if shutil.which(BWRAP) is None:
        raise RuntimeError(
            "the local code sandbox needs bubblewrap (bwrap), which is not installed: run `make install` "
            "as root (it installs Debian's bubblewrap), or `apt-get install bubblewrap` / `dnf install "
            "bubblewrap`; or run the code elsewhere (generation.agent.sandbox=http) or drop the tools that "
            "run code (generation.agent.tools)")
    ran = run_local("print(6 * 7)", Limits(wall_s=30))
    if ran.exit_code != 0 or ran.stdout != "42\n":
        raise RuntimeError(
            f"the local code sandbox (bubblewrap) cannot run here: {(ran.stderr or ran.stdout).strip()!r} "
            f"(exit code {ran.exit_code}). It needs bubblewrap 0.8 or newer and unprivileged user "
            "namespaces: enable them (sysctl user.max_user_namespaces=15000; on Debian kernels also "
            "kernel.unprivileged_userns_clone=1; on Ubuntu 24.04 "
            "kernel.apparmor_restrict_unprivileged_userns=0 or an AppArmor profile for bwrap; in a "
            "container, a seccomp profile that allows unshare), "
            "or use generation.agent.sandbox=http")
