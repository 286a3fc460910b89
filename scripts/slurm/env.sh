# Sourced by the sbatch scripts once `root` (the checkout) is set. Sets:
#   MEGARL_DEVICE  cuda on an allocation with GPUs unless set: a node whose torch or NCCL
#                  cannot use them fails naming what is missing (one without Transformer
#                  Engine runs the portable layers and says so, unless model.transformer_engine=true)
#   python         MEGARL_PYTHON, else the device's environment: .venv-cuda (make install
#                  DEVICE=cuda) or .venv; in a container, the image's /opt/megarl/venv
#   on_node        srun options that run a step in the container image, when one is given
#                  (MEGARL_CONTAINER_IMAGE, pyxis); empty otherwise
#   routable       a command printing this node's first non-loopback IPv4 address, if any
#   GLOO_SOCKET_IFNAME  unless set: the first interface NCCL_SOCKET_IFNAME selects, else the one
#                  holding the head's address (below)
# NCCL_*, UCX_*, NVTE_* and GLOO_SOCKET_IFNAME set when submitting reach every node: sbatch and
# srun export the whole environment, Ray's daemons inherit it and megarl's Ray workers are given it
# (worker_env.py).
if [ -n "${SLURM_GPUS_ON_NODE:-}${SLURM_JOB_GPUS:-}${SLURM_GPUS_PER_NODE:-}" ]; then
    export MEGARL_DEVICE=${MEGARL_DEVICE:-cuda}
fi
if [ -n "${MEGARL_CONTAINER_IMAGE:-}" ]; then
    # The image holds the environment (docker/Dockerfile), the checkout the code: it is mounted
    # at the same path and put on PYTHONPATH, so an edit needs no image rebuild.
    on_node=(--container-image="$MEGARL_CONTAINER_IMAGE" --container-workdir="$root"
             --container-mounts="$root:$root${MEGARL_CONTAINER_MOUNTS:+,$MEGARL_CONTAINER_MOUNTS}")
    python=${MEGARL_PYTHON:-/opt/megarl/venv/bin/python}
    export PYTHONPATH=$root${PYTHONPATH:+:$PYTHONPATH}
else
    on_node=()
    venv=.venv
    [ "${MEGARL_DEVICE:-}" = cuda ] && venv=.venv-cuda
    python=${MEGARL_PYTHON:-$root/$venv/bin/python}
    [ -x "$python" ] || { echo "megarl: $python is not an executable Python; run 'make install DEVICE=${MEGARL_DEVICE:-cpu}' in $root, or set MEGARL_PYTHON or MEGARL_CONTAINER_IMAGE" >&2; exit 2; }
fi
# `hostname --ip-address` is a loopback address on many distributions (/etc/hosts maps the hostname
# to 127.0.x.1), so loopback and IPv6 addresses are skipped.
routable='for ip in $(hostname --ip-address) $(hostname -I); do
    case $ip in 127.*|*:*) ;; *) echo "$ip"; exit 0;; esac; done'

# gloo (vLLM's group over every rank; on the CPU megarl's groups and trainer-rollout bridge) binds
# the address the hostname resolves to unless GLOO_SOCKET_IFNAME names an interface: that loopback
# address, where the other nodes' connections never arrive, so a multi-node job would hang at its
# first gloo group. The default is chosen here, on the job's first node, which holds the Ray head
# and the rendezvous, and given to every node (set it where the nodes' interface names differ):
# the first interface NCCL_SOCKET_IFNAME selects (NCCL's syntax: comma-separated name prefixes,
# exact names after `=`, all excluded after `^`; an exclusion never selects loopback), so gloo and
# NCCL share the network chosen; else the interface holding the head's address (MEGARL_RAY_HEAD_IP,
# else this node's first non-loopback IPv4). megarl's Ray workers started without it choose alike on
# their own node (megarl/trainer/worker_env.py, gloo_interface).
gloo_default() {
    local interfaces name address spec exclude=0 exact=0 listed item head
    interfaces=$(ip -o -4 addr show 2>/dev/null | awk '{split($4, a, "/"); print $2, a[1]}') || true
    [ -n "$interfaces" ] || { echo "megarl: no \`ip\` to list this node's interfaces: set GLOO_SOCKET_IFNAME for a multi-node job" >&2; return 0; }
    if [ -n "${NCCL_SOCKET_IFNAME:-}" ]; then
        spec=$NCCL_SOCKET_IFNAME
        [ "${spec#^}" = "$spec" ] || { exclude=1; spec=${spec#^}; }
        [ "${spec#=}" = "$spec" ] || { exact=1; spec=${spec#=}; }
        while read -r name address; do
            listed=0
            for item in ${spec//,/ }; do
                if [ "$exact" = 1 ]; then [ "$name" = "$item" ] && listed=1
                else case $name in "$item"*) listed=1 ;; esac; fi
            done
            if [ "$listed" != "$exclude" ] && ! { [ "$exclude" = 1 ] && [[ $address == 127.* ]]; }; then
                echo "$name NCCL_SOCKET_IFNAME=$NCCL_SOCKET_IFNAME"
                return 0
            fi
        done <<< "$interfaces"
        echo "megarl: NCCL_SOCKET_IFNAME=$NCCL_SOCKET_IFNAME selects none of this node's interfaces ($(echo $interfaces)); set it (and GLOO_SOCKET_IFNAME, which defaults to the first it selects) to the interface the nodes reach each other on" >&2
        return 2
    fi
    head=${MEGARL_RAY_HEAD_IP:-$(bash -c "$routable")}
    while read -r name address; do
        [ -z "$head" ] || [ "$address" != "$head" ] || { echo "$name the head's address $head"; return 0; }
    done <<< "$interfaces"
}
if [ -z "${GLOO_SOCKET_IFNAME:-}" ]; then
    gloo=$(gloo_default) || exit 2
    if [ -n "$gloo" ]; then
        export GLOO_SOCKET_IFNAME=${gloo%% *}
        echo "megarl: GLOO_SOCKET_IFNAME defaults to $GLOO_SOCKET_IFNAME (from ${gloo#* })" >&2
    fi
fi
env | grep -E '^(NCCL_|UCX_|NVTE_|GLOO_SOCKET_IFNAME=)' | sed 's/^/megarl: forwarding /' >&2 || true
