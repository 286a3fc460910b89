"""A real one-node Slurm for tests: munged, slurmctld and slurmd from Debian's packages, started
as root with their own key, socket, ports, state and logs under a temporary directory (nothing of
the machine's own Slurm or munge configuration is read or changed). Jobs see it through the
SLURM_CONF environment variable."""

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
from typing import Iterator, Optional

from megarl.parallel_state.megatron_groups import free_port

PACKAGES = ("slurmctld", "slurmd", "slurm-client", "munge")
PROGRAMS = ("slurmctld", "slurmd", "sbatch", "munged")


def _missing() -> list:
    return [p for p in PROGRAMS if shutil.which(p) is None]


def unavailable_reason() -> Optional[str]:
    """None when Slurm and munge are installed (installing Debian's packages with apt-get when
    they are missing and this process may); otherwise why they cannot be."""
    if not _missing():
        return None
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        return (f"{', '.join(_missing())} not installed, and installing {' '.join(PACKAGES)} needs "
                "root and apt-get (this is not a root Debian/Ubuntu machine)")
    install = ["apt-get", "install", "-y", "--no-install-recommends", *PACKAGES]
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    proc = subprocess.run(install, capture_output=True, text=True, env=env, timeout=900)
    if proc.returncode != 0:  # a fresh machine may have no package lists yet
        subprocess.run(["apt-get", "update"], capture_output=True, env=env, timeout=900)
        proc = subprocess.run(install, capture_output=True, text=True, env=env, timeout=900)
    if _missing():
        return f"apt-get could not install {' '.join(PACKAGES)}: {proc.stderr.strip()[-500:]}"
    return None


def _config(root: str, munge_socket: str) -> str:
    node = subprocess.run(["slurmd", "-C"], capture_output=True, text=True, check=True).stdout
    node_line = node.splitlines()[0]  # NodeName=... CPUs=... RealMemory=... as slurmd sees them
    return "\n".join([
        "ClusterName=megarltest", f"SlurmctldHost={socket.gethostname()}",
        "SlurmUser=root", "SlurmdUser=root",
        "AuthType=auth/munge", "CredType=cred/munge", f"AuthInfo=socket={munge_socket}",
        # No cgroups in a container: track processes by parent id, bind nothing.
        "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none", "MpiDefault=none",
        "SelectType=select/cons_tres", "SelectTypeParameters=CR_CPU", "ReturnToService=2",
        "JobCompType=jobcomp/none", "AccountingStorageType=accounting_storage/none",
        # Never purge finished jobs: `sbatch --wait` then polls every 2 s instead of backing off
        # to 8 and 32 s (its back-off keeps below MinJobAge / 2, default 300 s), which added up
        # to half a minute to each job here.
        "MinJobAge=0",
        f"SlurmctldPort={free_port()}", f"SlurmdPort={free_port()}",
        f"StateSaveLocation={root}/state", f"SlurmdSpoolDir={root}/spool",
        f"SlurmctldPidFile={root}/slurmctld.pid", f"SlurmdPidFile={root}/slurmd.pid",
        f"SlurmctldLogFile={root}/slurmctld.log", f"SlurmdLogFile={root}/slurmd.log",
        f"{node_line} State=UNKNOWN",
        "PartitionName=megarl Nodes=ALL Default=YES MaxTime=INFINITE State=UP", ""])


def _start_munge(root: str) -> str:
    munge = os.path.join(root, "munge")
    os.makedirs(munge, mode=0o711)
    key = os.path.join(munge, "munge.key")
    with open(key, "wb") as f:
        f.write(os.urandom(128))
    os.chmod(key, 0o600)
    sock = os.path.join(munge, "munge.sock")
    subprocess.run(["munged", "--force", f"--socket={sock}", f"--key-file={key}",
                    f"--pid-file={munge}/munged.pid", f"--log-file={munge}/munged.log",
                    f"--seed-file={munge}/munged.seed"], check=True, timeout=30)
    return sock


@contextlib.contextmanager
def local_slurm(root: str, timeout_s: float = 60) -> Iterator[dict]:
    """Start the cluster in `root`; yield the environment its clients need; stop it."""
    os.makedirs(os.path.join(root, "state"))
    os.makedirs(os.path.join(root, "spool"))
    munge_socket = _start_munge(root)
    conf = os.path.join(root, "slurm.conf")
    with open(conf, "w") as f:
        f.write(_config(root, munge_socket))
    env = {**os.environ, "SLURM_CONF": conf}
    daemons = [subprocess.Popen([daemon, "-D", "-f", conf], env=env, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL) for daemon in ("slurmctld", "slurmd")]
    try:
        deadline = time.time() + timeout_s
        state = ""
        while state != "idle":
            if time.time() > deadline:
                logs = "".join(open(os.path.join(root, name)).read()[-2000:]
                               for name in ("slurmctld.log", "slurmd.log")
                               if os.path.exists(os.path.join(root, name)))
                raise RuntimeError(f"the Slurm node is '{state}', not idle, after {timeout_s} s\n{logs}")
            time.sleep(1)
            state = subprocess.run(["sinfo", "-h", "-o", "%T"], env=env, capture_output=True,
                                   text=True).stdout.strip()
        yield env
    finally:
        # Jobs first: their steps (slurmstepd) outlive the daemons otherwise.
        subprocess.run(["scancel", "--partition=megarl"], env=env, capture_output=True)
        time.sleep(2)
        for daemon in daemons:
            daemon.send_signal(signal.SIGTERM)
        for daemon in daemons:
            try:
                daemon.wait(timeout=30)
            except subprocess.TimeoutExpired:
                daemon.kill()
        subprocess.run(["munged", "--stop", f"--socket={munge_socket}"], capture_output=True)
