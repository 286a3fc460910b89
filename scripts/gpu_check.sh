#!/usr/bin/env bash
# The GPU check on a machine with only Python, torch (CUDA) and transformers: installs the wheels
# `make gpu-wheels` made (megatron-core and the rest megarl imports that such a machine lacks) into
# a temporary folder, puts that and this checkout on PYTHONPATH (nothing is installed into the
# machine's Python), then runs scripts/gpu_check.py: HF parity of every family in fp32 and bf16,
# bench_train dense and MoE in bf16, the memory plan against measured peaks, the sync's copies.
#
#   bash scripts/gpu_check.sh --wheels .gpu-wheels --out "$OUT"     # on the GPU machine
#   bash scripts/gpu_check.sh --device cpu --out /tmp/gpu_check     # the same steps, CPU-sized
#
# Options: --wheels DIR (none: the Python already has them), --out DIR (default: $OUT, else a new
# temporary folder), --device cuda|cpu (default cuda), --python BIN (default: the project's
# environment for that device when `make install` made one, .venv-cuda or .venv, else python3); the
# rest goes to scripts/gpu_check.py (--budget-s, --families, --jobs). The GPU path runs Megatron's portable layer
# spec on CUDA (MEGARL_TRANSFORMER_ENGINE=false): the check machine has no Transformer Engine.
# Results: DIR/gpu_check.json and DIR/gpu_check.log; exit 1 when a step failed or a check did not hold.
set -u -o pipefail
absolute() { case "$1" in /*|"") echo "$1" ;; *) echo "$PWD/$1" ;; esac; }  # before the cd below
wheels="" out="${OUT:-}" device=cuda python="" rest=()
while [ $# -gt 0 ]; do
  case "$1" in
    --wheels) wheels=$(absolute "$2"); shift 2 ;;
    --out) out=$(absolute "$2"); shift 2 ;;
    --device) device=$2; shift 2 ;;
    --python) python=$2; shift 2 ;;
    *) rest+=("$1"); shift ;;
  esac
done
cd "$(dirname "$0")/.."
case "$device" in
  cuda|cpu) ;;
  *) echo "gpu_check.sh: --device $device: use cuda or cpu" >&2; exit 2 ;;
esac
if [ -n "$wheels" ] && ! ls "$wheels"/*.whl >/dev/null 2>&1; then
  echo "gpu_check.sh: --wheels $wheels holds no .whl files: run 'make gpu-wheels' where the package index is reachable" >&2
  exit 2
fi
if [ -z "$python" ]; then
  venv=.venv; [ "$device" = cuda ] && venv=.venv-cuda
  python=python3; [ -x "$venv/bin/python" ] && python=$venv/bin/python
fi
if ! "$python" -c "import torch" >/dev/null 2>&1; then
  echo "gpu_check.sh: $python cannot import torch: run 'make install' (the check then takes the project's" \
       "environment), or give --python BIN, a Python with torch" >&2
  exit 2
fi
[ -n "$out" ] || out=$(mktemp -d)
mkdir -p "$out"
log="$out/gpu_check.log"
if [ -n "$wheels" ]; then
  site=$(mktemp -d)/site
  echo "== $(date +%T) installing $(ls "$wheels"/*.whl | wc -l) wheels into $site" >>"$log"
  # --no-deps: the folder holds every wheel needed, and the machine's own packages stay as they are
  if ! "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" \
      "$wheels"/*.whl >>"$log" 2>&1; then
    echo "gpu_check.sh: installing the wheels of $wheels failed: see $log" >&2
    exit 1
  fi
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export MEGARL_DEVICE="$device" MEGARL_TRANSFORMER_ENGINE=false PYTHONUNBUFFERED=1
exec "$python" scripts/gpu_check.py --device "$device" --out "$out" ${rest[@]+"${rest[@]}"}
