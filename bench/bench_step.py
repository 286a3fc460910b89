"""One training step of the demo config (configs/demo_cpu.yaml), broken down by phase.

  python bench/bench_step.py [--quick] [--steps N]

Makes the demo's inputs once (runs/bench_inputs), runs the trainer exactly as a user does
(Ray, EP2, real vLLM) for a few steps, and summarises its metrics.jsonl: the median seconds of
every phase over the steps after the first (which includes vLLM's warm-up), tokens/s, model
TFLOP/s per device, peak memory, and the weight sync's share of the step (target <= 10%).
Prints one JSON object. Does not time anything itself: the loop's own phase timers are the
measurement, so the numbers are the ones a run logs.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SYNC_SHARE_TARGET = 0.10


def _run(*args: str) -> None:
    subprocess.run([sys.executable, *args], cwd=ROOT, check=True, stdout=sys.stderr)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="5 steps instead of --steps")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--inputs", default="runs/bench_inputs")
    parser.add_argument("--run-dir", default="runs/bench_step")
    args = parser.parse_args()
    steps = 5 if args.quick else args.steps
    if steps < 2:
        sys.exit(f"--steps {steps}: need at least 2 (the first step is vLLM's warm-up and is left out)")
    inputs = os.path.join(ROOT, args.inputs)
    if not os.path.isfile(os.path.join(inputs, "train.jsonl")):
        _run("scripts/prepare_demo.py", "--out", inputs)
    run_dir = os.path.join(ROOT, args.run_dir)
    metrics_file = os.path.join(run_dir, "metrics.jsonl")
    if os.path.exists(metrics_file):
        os.remove(metrics_file)  # a fresh run, not a resumed one
    _run("scripts/train_ppo_moe.py", "--config", "configs/demo_cpu.yaml", f"steps={steps}",
         f"run_dir={run_dir}", f"model.hf_dir={os.path.join(inputs, 'model')}",
         f"model.megatron_dir={os.path.join(inputs, 'megatron')}",
         f"data.path={os.path.join(inputs, 'train.jsonl')}", "checkpoint.every=0",
         "checkpoint.export_hf=false")
    with open(metrics_file) as f:
        rows = [json.loads(line) for line in f][1:]

    def median(key):
        return statistics.median(r[key] for r in rows)

    phases = {k[len("time/"):]: median(k) for k in rows[0] if k.startswith("time/")}
    step_seconds = statistics.median(sum(v for k, v in r.items() if k.startswith("time/")) for r in rows)
    sync_share = phases["sync"] / step_seconds
    print(json.dumps({
        "case": "demo_step", "config": "configs/demo_cpu.yaml", "steps_measured": len(rows),
        "step_seconds": step_seconds, "phase_seconds": phases,
        "phase_share": {k: v / step_seconds for k, v in phases.items()},
        "tokens_per_s": median("throughput/tokens_per_s"),
        "tflops_per_device": median("throughput/tflops_per_device"),
        "peak_memory_bytes": max(r["memory/peak_bytes"] for r in rows),
        "offloaded_bytes": median("memory/offloaded_bytes"),
        "sync_share": sync_share, "sync_share_target": SYNC_SHARE_TARGET,
        "sync_share_holds": sync_share <= SYNC_SHARE_TARGET,
    }))


if __name__ == "__main__":
    main()
