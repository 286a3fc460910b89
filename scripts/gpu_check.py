"""The GPU check: megarl's trainer side on one GPU, in one JSON file, within a time budget.

  bash scripts/gpu_check.sh [--wheels DIR] [--out DIR]      # the way to run it (installs first)
  python scripts/gpu_check.py --device cuda|cpu --out DIR [--budget-s S] [--families a,b]

Steps, each a process of its own with its own timeout (cut to what is left of --budget-s), one's
failure recorded and the next run:
  parity            HF parity of every family (bench/parity_sweep.py), fp32 then bf16, world 1:
                    conversion and verify_conversion's check with gradients
  memory_<model>    the memory plan's per-phase peaks against the measured ones on a slice of
                    Qwen3-30B-A3B and DeepSeek-V3 (bench/memory_slice.py): published widths on
                    cuda (torch.cuda.max_memory_allocated), tiny ones on cpu (the resident set)
  logprob_head      bench/bench_memory.py: the log-prob head alone (each kernel, and Megatron-Core's
                    vocab_parallel_cross_entropy beside it) on 16K x 151,936 bf16 logits on cuda:
                    seconds and peak; fails when a kernel's peak is over 1.0x the fp32 logits
  bench_train_*     bench/bench_train.py, bf16: dense at a real vocabulary (hidden 4096, 4 layers,
                    vocab 151,936, 16K-token micro-batches on cuda: fails when the update's overhead
                    over bare Megatron is over 10% or packing under 1.5x), and MoE (hidden 2048)
  sync_copies       bench/bench_sync_copies.py (a Qwen3-30B-A3B TP8 rank's expert slabs on cuda)
--device cpu runs the same steps at CPU sizes (the smoke test's: about 80 s of CPU time), --jobs 2
of them at once on a machine with two cores (a GPU runs one at a time).
Writes DIR/gpu_check.json (rewritten after every step: a killed run keeps what it finished) and
DIR/gpu_check.log (every step's output); exits 1 when a step failed or a check did not hold.
"""

import argparse
import concurrent.futures
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Dict, List

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FAMILIES = ["llama", "qwen2", "qwen3", "qwen3_moe", "mixtral", "llama_tied", "qwen2_gqa1", "glm4_moe",
            "deepseek_v3", "gpt_oss", "qwen3_next", "qwen3_5_moe"]
MEMORY_MODELS = ("qwen3-30b-a3b", "deepseek-v3")
# bench_train's model and batch per device and kind. cuda dense: the H200 shapes of issue 48, where
# the update is compute-bound and the vocabulary-sized head weighs (hidden 4096, 4 layers, Qwen3's
# vocabulary, 32 sequences of up to 4,096 tokens in 16K-token micro-batches; hidden 2048 was
# launch-bound: packing 1.13x). cuda MoE: hidden 2048, 8 layers, bench_train's 8 experts, top-2,
# 32 sequences of up to 2,048 tokens. 16 host threads draw the random checkpoints (the timed work is
# the GPU's).
BENCH_TRAIN = {
    "cuda": {"dense": ["--hidden", "4096", "--layers", "4", "--vocab", "151936", "--seq-len", "4096",
                       "--sequences", "32", "--micro-batch-tokens", "16384", "--repeats", "3",
                       "--threads", "16"],
             "moe": ["--hidden", "2048", "--layers", "8", "--vocab", "32768", "--seq-len", "2048",
                     "--sequences", "32", "--repeats", "3", "--threads", "16"]},
    "cpu": {kind: ["--hidden", "128", "--layers", "2", "--vocab", "1024", "--seq-len", "64",
                   "--sequences", "4", "--repeats", "1"] for kind in ("dense", "moe")},
}
# What the dense case must hold on a GPU (bench_train's own targets): the cpu sizes time nothing.
UPDATE_OVERHEAD_MAX, PACKING_MIN = 0.10, 1.5
LOGPROB_HEAD = {"cuda": ["--tokens", "16384", "--vocab", "151936", "--repeats", "5"],
                "cpu": ["--tokens", "2048", "--vocab", "32768"]}  # the resident set needs MBs to measure
SYNC_COPIES = {"cuda": ["--experts", "128", "--hidden", "2048", "--width", "768"],
               "cpu": ["--quick", "--experts", "8", "--hidden", "256", "--width", "64", "--copy-mib", "8"]}
# Seconds per step. cuda: what fits the device tool's 10 minutes with the machine's start and the
# install outside them; cpu: a loaded 2-core machine.
TIMEOUT_S = {"cuda": {"parity": 150, "memory": 100, "logprob_head": 90, "bench_train_dense": 200,
                      "bench_train_moe": 110, "sync_copies": 60},
             "cpu": {"parity": 400, "memory": 200, "logprob_head": 200, "bench_train_dense": 200,
                     "bench_train_moe": 200, "sync_copies": 100}}


@dataclass
class Step:
    name: str
    argv: List[str]  # after the Python interpreter
    timeout_s: float
    env: Dict[str, str] = field(default_factory=dict)


def plan_steps(device: str, families: List[str], work: str) -> List[Step]:
    """Pure: the steps of a check on `device`, in the order they run."""
    limits = TIMEOUT_S[device]
    steps = [Step("parity", ["bench/parity_sweep.py", "--dtypes", "float32,bfloat16", "--work", work,
                             "--families", ",".join(families)], limits["parity"])]
    for model in MEMORY_MODELS:
        widths = "real" if device == "cuda" else "tiny"
        # glibc hands freed blocks over 64 KB back at once, so the resident set follows the tensors
        # alive (bench_memory.py's phase check); the CUDA allocator ignores it.
        steps.append(Step(f"memory_{model}", ["bench/memory_slice.py", "--model", model, "--widths", widths],
                          limits["memory"], {"MALLOC_MMAP_THRESHOLD_": "65536"}))
    steps.append(Step("logprob_head", ["bench/bench_memory.py", "--device", device, "--no-phases",
                                       "--megatron", *LOGPROB_HEAD[device]], limits["logprob_head"]))
    for kind, family in (("dense", "qwen3"), ("moe", "qwen3_moe")):
        steps.append(Step(f"bench_train_{kind}", [
            "bench/bench_train.py", "--family", family, "--dtype", "bfloat16", *BENCH_TRAIN[device][kind],
            # without the LoRA case: on the GPU it needs the portable spec, and its time is budgeted
            "--lora-rank", "0", "--inputs", os.path.join(work, "bench_train")],
            limits[f"bench_train_{kind}"]))
    steps.append(Step("sync_copies", ["bench/bench_sync_copies.py", "--device", device, *SYNC_COPIES[device]],
                      limits["sync_copies"]))
    return steps


def json_lines(text: str) -> List[dict]:
    """Every line of `text` that is a JSON object (the workers print one per result)."""
    rows = []
    for line in text.splitlines():
        if line.startswith("{"):
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                pass  # a partial line of a killed process
    return rows


def run_step(step: Step, deadline: float, log) -> dict:
    """Run one step for at most its timeout, and not past `deadline` (time.monotonic()); its
    output goes to `log`."""
    limit = max(1.0, min(step.timeout_s, deadline - time.monotonic()))
    log.write(f"\n== {time.strftime('%H:%M:%S')} {step.name} (limit {limit:.0f} s): {' '.join(step.argv)}\n")
    log.flush()
    start = time.perf_counter()
    # A session of its own: a step cut at its limit is stopped with the processes it started
    # (the checkpoint writers).
    proc = subprocess.Popen([sys.executable, *step.argv], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, **step.env},
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=limit)
        rc = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        rc = "timeout"
    log.write(out + err)
    log.flush()
    result = {"rc": rc, "seconds": round(time.perf_counter() - start, 1), "limit_s": round(limit),
              "results": json_lines(out)}
    if rc != 0:
        result["stderr_tail"] = err[-2000:]
    return result


def problems(steps: Dict[str, dict], families: List[str], device: str = "cuda") -> List[str]:
    """Pure: what did not hold, one line each (empty when the check passed). Speed targets are
    judged on cuda only: the cpu sizes time nothing."""
    out = [f"{name}: exit {step['rc']}" for name, step in steps.items() if step["rc"] != 0]
    if "parity" in steps:
        rows = {(r["dtype"], r["model"]): r for r in steps["parity"]["results"]}
        for dtype in ("float32", "bfloat16"):
            for family in families:
                row = rows.get((dtype, family))
                if row is None:
                    out.append(f"parity {dtype} {family}: no result")
                elif not row.get("within_tolerance"):
                    why = row.get("error") or f"outside {json.dumps(row['tolerance'])}"
                    out.append(f"parity {dtype} {family}: {why}")
    for name, step in steps.items():
        if name.startswith("memory_"):
            row = step["results"][-1] if step["results"] else None
            if row is None:
                out.append(f"{name}: no result")
            elif not row["within_bound"]:
                out.append(f"{name}: worst error {row['worst_error']} > {row['bound']}")
        elif name.startswith("bench_train_"):
            cases = {r.get("case"): r for r in step["results"]}
            if set(cases) != {"actor_update_vs_bare", "packed_vs_padded"}:
                out.append(f"{name}: cases {sorted(c for c in cases if c)}")
            elif name == "bench_train_dense" and device == "cuda":
                overhead = cases["actor_update_vs_bare"]["overhead_ratio"]
                packing = cases["packed_vs_padded"]["speedup"]
                if overhead > UPDATE_OVERHEAD_MAX:
                    out.append(f"{name}: update overhead {overhead:.3f} > {UPDATE_OVERHEAD_MAX}")
                if packing < PACKING_MIN:
                    out.append(f"{name}: packing {packing:.2f}x < {PACKING_MIN}x")
        elif name == "logprob_head":
            heads = [r for r in step["results"] if r.get("case") == "head"]
            if not heads:
                out.append(f"{name}: no result")
            out += [f"{name}: {r['kernels']} peak {r['peak_over_fp32_logits']:.2f}x the fp32 logits > 1.0x"
                    for r in heads if not r["meets_target"]]
        elif name == "sync_copies" and not step["results"]:
            out.append("sync_copies: no result")
    return out


def environment(device: str) -> dict:
    """Versions and the machine. The GPU's name from nvidia-smi: a CUDA context in this process
    would hold GPU memory through every step."""
    from importlib import metadata

    import torch

    versions = {}
    for name in ("megatron-core", "transformers", "numpy", "safetensors"):
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    try:
        gpu = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version",
                              "--format=csv,noheader"], capture_output=True, text=True,
                             timeout=30).stdout.strip() or None
    except (OSError, subprocess.TimeoutExpired):
        gpu = None
    return {"device": device, "python": platform.python_version(), "torch": torch.__version__,
            "torch_cuda": torch.version.cuda, "gpu": gpu, **versions, "cpus": os.cpu_count(),
            **{k: os.environ.get(k) for k in ("MEGARL_DEVICE", "MEGARL_TRANSFORMER_ENGINE")}}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--device", default="cuda", choices=sorted(TIMEOUT_S))
    parser.add_argument("--out", default=os.environ.get("OUT") or None,
                        help="folder for gpu_check.json and gpu_check.log (default: $OUT)")
    parser.add_argument("--budget-s", type=float,
                        help="every step within it (default: 540 on cuda, 1200 on cpu)")
    parser.add_argument("--families", default=",".join(FAMILIES),
                        help="parity's, comma-separated (default: all eleven)")
    parser.add_argument("--jobs", type=int, default=1,
                        help="steps run at once (default 1: on a GPU each step has the device to itself; "
                             "on a CPU machine with cores to spare, 2)")
    args = parser.parse_args()
    if not args.out:
        parser.error("--out: give the folder for the results (or set OUT)")
    families = [f for f in args.families.split(",") if f]
    unknown = sorted(set(families) - set(FAMILIES))
    if unknown:
        parser.error(f"--families: unknown {unknown}; choose from {FAMILIES}")
    if args.jobs < 1 or (args.jobs > 1 and args.device == "cuda"):
        parser.error(f"--jobs {args.jobs}: 1, or more with --device cpu (GPU steps measure the "
                     "device's memory and time: one at a time)")
    budget = args.budget_s or (540 if args.device == "cuda" else 1200)
    deadline = time.monotonic() + budget
    os.makedirs(args.out, exist_ok=True)
    # Checkpoints outside --out: a run cut short leaves only the two files there (the device tool
    # brings back at most 8)
    work = tempfile.mkdtemp(prefix="gpu_check_")
    report = {"device": args.device, "started": time.strftime("%Y-%m-%dT%H:%M:%S"), "budget_s": budget,
              "environment": environment(args.device), "steps": {}}
    path = os.path.join(args.out, "gpu_check.json")
    steps = plan_steps(args.device, families, work)
    with open(os.path.join(args.out, "gpu_check.log"), "a") as log, \
            concurrent.futures.ThreadPoolExecutor(max_workers=args.jobs) as pool:
        # what a run killed from outside leaves: the steps done, and those not
        report.update(problems=[f"not finished: {', '.join(s.name for s in steps)}"], passed=False)
        with open(path, "w") as f:
            json.dump(report, f, indent=1)
        # each step's output is written to the log whole, when it ends
        running = {pool.submit(run_step, step, deadline, log): step for step in steps}
        for future in concurrent.futures.as_completed(running):
            step = running[future]
            report["steps"][step.name] = future.result()
            print(f"{step.name}: exit {report['steps'][step.name]['rc']} in "
                  f"{report['steps'][step.name]['seconds']} s", flush=True)
            left = [s.name for s in steps if s.name not in report["steps"]]
            report["problems"] = problems(report["steps"], families, args.device) + (
                [f"not finished: {', '.join(left)}"] if left else [])
            report["passed"] = not report["problems"]
            with open(path, "w") as f:
                json.dump(report, f, indent=1)
    shutil.rmtree(work, ignore_errors=True)
    print(json.dumps({"passed": report["passed"], "problems": report["problems"], "json": path}))
    sys.exit(0 if report["passed"] else 1)


if __name__ == "__main__":
    main()
