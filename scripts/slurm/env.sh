# Sourced by the sbatch scripts once `root` (the checkout) is set. Sets:
#   MEGARL_DEVICE  cuda on an allocation with GPUs unless set: a node whose torch, NCCL or
#                  Transformer Engine cannot use them fails naming what is missing
#   python         MEGARL_PYTHON, else the device's environment: .venv-cuda (make install
#                  DEVICE=cuda) or .venv; in a container, the image's /opt/megarl/venv
#   on_node        srun options that run a step in the container image, when one is given
#                  (MEGARL_CONTAINER_IMAGE, pyxis); empty otherwise
# NCCL_*, UCX_* and NVTE_* set when submitting reach every node: sbatch and srun export the whole
# environment, Ray's daemons inherit it and megarl's Ray workers are given it (worker_env.py).
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
env | grep -E '^(NCCL|UCX|NVTE)_' | sed 's/^/megarl: forwarding /' >&2 || true
