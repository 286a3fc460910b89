"""scripts/slurm/env.sh, which both sbatch scripts source: the device, the environment's Python,
the container options, gloo's interface, and what it says about forwarded network settings.
Sourced by bash with a made-up checkout and a made-up node (its `ip` and `hostname` list the
interfaces in NODE); the sbatch scripts themselves run on a real Slurm in tests/test_slurm.py."""

import os
import subprocess

import pytest

from tests.launch import ROOT

ENV_SH = os.path.join(ROOT, "scripts", "slurm", "env.sh")
CLEAN = {"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", "/root")}
# A node whose hostname resolves to loopback (as /etc/hosts has it on many distributions), its
# interfaces in `ip -o -4 addr show`'s order.
NODE = [("lo", "127.0.0.1/8"), ("eth0", "10.0.0.5/16"), ("ib0", "10.1.0.5/16"), ("ib1", "10.2.0.5/16")]


def _source(checkout, **env):
    script = (f'set -euo pipefail; root={checkout}; source {ENV_SH}; '
              'echo "device=${MEGARL_DEVICE:-}"; echo "python=$python"; '
              'echo "pythonpath=${PYTHONPATH:-}"; printf "on_node=%s\\n" "${on_node[@]}"; '
              'echo "gloo=${GLOO_SOCKET_IFNAME:-}"')
    bin_dir = checkout / "node_bin"
    path = f"{bin_dir}:{CLEAN['PATH']}"
    proc = subprocess.run(["bash", "-c", script], env={**CLEAN, "PATH": path, **env}, capture_output=True,
                          text=True)
    lines = [line.split("=", 1) for line in proc.stdout.splitlines()]
    out = {}
    for key, value in lines:
        out.setdefault(key, []).append(value)
    return proc.returncode, {k: v if k == "on_node" else v[0] for k, v in out.items()}, proc.stderr


def _command(path, text):
    path.write_text(f"#!/bin/sh\n{text}")
    path.chmod(0o755)


@pytest.fixture
def checkout(tmp_path):
    for venv in (".venv", ".venv-cuda"):
        python = tmp_path / venv / "bin" / "python"
        python.parent.mkdir(parents=True)
        _command(python, "")
    bin_dir = tmp_path / "node_bin"
    bin_dir.mkdir()
    lines = "".join(f"{i + 1}: {name}    inet {address} scope global {name}\\       valid_lft forever\n"
                    for i, (name, address) in enumerate(NODE))
    _command(bin_dir / "ip", f"cat <<'EOF'\n{lines}EOF\n")
    _hostname(checkout=tmp_path, addresses=[address.split("/")[0] for _, address in NODE[1:]] + ["fd00::5"])
    return tmp_path


def _hostname(checkout, addresses):
    """`hostname --ip-address`: loopback; `hostname -I`: `addresses`."""
    listed = " ".join(addresses)
    _command(checkout / "node_bin" / "hostname",
             f'case "$1" in --ip-address) echo 127.0.1.1;; -I) echo "{listed}";; esac\n')


def test_cpu_allocation_uses_the_cpu_environment(checkout):
    rc, out, _ = _source(checkout)
    assert rc == 0 and out["device"] == "" and out["python"] == f"{checkout}/.venv/bin/python"
    assert out.get("on_node", [""]) == [""]


def test_gpu_allocation_asks_for_cuda_and_its_environment(checkout):
    rc, out, _ = _source(checkout, SLURM_GPUS_ON_NODE="8")
    assert rc == 0 and out["device"] == "cuda" and out["python"] == f"{checkout}/.venv-cuda/bin/python"
    # an explicit choice stands
    rc, out, _ = _source(checkout, SLURM_GPUS_ON_NODE="8", MEGARL_DEVICE="cpu")
    assert rc == 0 and out["device"] == "cpu" and out["python"] == f"{checkout}/.venv/bin/python"


def test_missing_gpu_environment_names_the_install(checkout):
    (checkout / ".venv-cuda" / "bin" / "python").unlink()
    rc, _, err = _source(checkout, SLURM_JOB_GPUS="0,1")
    assert rc == 2 and f"{checkout}/.venv-cuda/bin/python is not an executable Python; run " \
        f"'make install DEVICE=cuda' in {checkout}" in err


def test_container_image_runs_steps_in_it_with_the_checkout_mounted(checkout):
    rc, out, _ = _source(checkout, SLURM_GPUS_ON_NODE="8", MEGARL_CONTAINER_IMAGE="/images/megarl.sqsh",
                         MEGARL_CONTAINER_MOUNTS="/data:/data", PYTHONPATH="/extra")
    assert rc == 0 and out["python"] == "/opt/megarl/venv/bin/python"
    assert out["on_node"] == ["--container-image=/images/megarl.sqsh", f"--container-workdir={checkout}",
                              f"--container-mounts={checkout}:{checkout},/data:/data"]
    assert out["pythonpath"] == f"{checkout}:/extra"


def test_forwarded_network_settings_are_listed(checkout):
    rc, _, err = _source(checkout, NCCL_IB_HCA="mlx5_0", UCX_NET_DEVICES="mlx5_0:1", GLOO_SOCKET_IFNAME="ib1",
                         OTHER="x")
    assert rc == 0
    assert sorted(err.splitlines()) == ["megarl: forwarding GLOO_SOCKET_IFNAME=ib1",
                                        "megarl: forwarding NCCL_IB_HCA=mlx5_0",
                                        "megarl: forwarding UCX_NET_DEVICES=mlx5_0:1"]


@pytest.mark.parametrize("env, chosen, reason", [
    # the interface holding the head's address: the first non-loopback one, or the one given
    ({}, "eth0", "the head's address 10.0.0.5"),
    ({"MEGARL_RAY_HEAD_IP": "10.1.0.5"}, "ib0", "the head's address 10.1.0.5"),
    # the first interface NCCL's own setting selects: prefixes, exact names, exclusions
    ({"NCCL_SOCKET_IFNAME": "ib"}, "ib0", "NCCL_SOCKET_IFNAME=ib"),
    ({"NCCL_SOCKET_IFNAME": "=ib1,eth0"}, "eth0", "NCCL_SOCKET_IFNAME==ib1,eth0"),  # the node's order
    ({"NCCL_SOCKET_IFNAME": "^docker"}, "eth0", "NCCL_SOCKET_IFNAME=^docker"),  # never loopback
    ({"NCCL_SOCKET_IFNAME": "^lo,eth"}, "ib0", "NCCL_SOCKET_IFNAME=^lo,eth"),
    ({"NCCL_SOCKET_IFNAME": "^=ib0,eth0,lo"}, "ib1", "NCCL_SOCKET_IFNAME=^=ib0,eth0,lo"),
])
def test_gloo_interface_defaults_to_nccls_or_the_heads(checkout, env, chosen, reason):
    """Without GLOO_SOCKET_IFNAME gloo would bind the hostname's loopback address (127.0.1.1 here),
    which no other node reaches."""
    rc, out, err = _source(checkout, **env)
    assert rc == 0 and out["gloo"] == chosen, err
    assert f"megarl: GLOO_SOCKET_IFNAME defaults to {chosen} (from {reason})" in err.splitlines()
    assert f"megarl: forwarding GLOO_SOCKET_IFNAME={chosen}" in err.splitlines()


def test_gloo_interface_given_stands(checkout):
    rc, out, err = _source(checkout, GLOO_SOCKET_IFNAME="ib1", NCCL_SOCKET_IFNAME="eth")
    assert rc == 0 and out["gloo"] == "ib1" and "defaults" not in err


@pytest.mark.parametrize("nccl", ["enp", "=ib"])
def test_nccl_interfaces_that_match_nothing_are_refused(checkout, nccl):
    rc, _, err = _source(checkout, NCCL_SOCKET_IFNAME=nccl)
    assert rc == 2
    assert (f"megarl: NCCL_SOCKET_IFNAME={nccl} selects none of this node's interfaces (lo 127.0.0.1 eth0 "
            "10.0.0.5 ib0 10.1.0.5 ib1 10.2.0.5); set it (and GLOO_SOCKET_IFNAME, which defaults to the "
            "first it selects) to the interface the nodes reach each other on") in err


def test_a_node_without_a_routable_address_leaves_gloo_alone(checkout):
    """A one-node job on a machine with loopback and IPv6 only: gloo's own choice works there."""
    _hostname(checkout, ["fd00::5"])
    rc, out, err = _source(checkout)
    assert rc == 0 and out["gloo"] == "" and "GLOO" not in err
