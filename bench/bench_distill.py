"""On-policy distillation against the reward alone, on the distillation demo's student: how many
training steps each takes to reach the same held-out accuracy.

  python bench/bench_distill.py [--inputs DIR] [--runs DIR] [--seeds 0,1,2] [--steps 40] [--every 2]
                                [--rises 0.15,0.25,0.35]

Inputs: scripts/prepare_demo.py --teacher-steps 200 --hf-only (made in a temporary folder unless
--inputs names a folder it made). Per run
seed, two runs of configs/demo_distill_cpu.yaml at world size 1 (without torchrun), side by side
(the two CPU cores each take one; steps are counted, not seconds), the held-out additions
evaluated greedily every --every steps:
  distill  the config as it is: algo.reward none, the teacher's per-token reverse-KL term
  reward   algo.reward math and no teacher (teacher.hf_dir '' and algo.distill.coeff 0): GRPO's
           group-relative advantages of the right answers, as the reward-only demo trains
Both start from the same weights, so from the same at-start accuracy; each target is that plus one
of --rises (0.15: the suite's bar, tests/test_loop.py::test_distillation_demo_closes_half_the_gap;
0.35: half the demo's gap to its teacher). One JSON object per seed: each mode's held-out accuracy
at each evaluation and, per target, the first evaluated step at or above it (null: not within
--steps); then a summary over the seeds. --runs DIR keeps the runs there, and a run DIR already
holds to its last step is read instead of run again (to summarize other targets).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "bench")]

from paired_timing import json_stdout  # noqa: E402

from megarl.parallel_state.megatron_groups import free_port  # noqa: E402

MODES = {"distill": (), "reward": ("algo.reward=math", 'teacher.hf_dir=""', "algo.distill.coeff=0")}
ACCURACY = "eval/heldout/all/accuracy"


def launch(inputs: str, run_dir: str, seed: int, steps: int, every: int, mode: str) -> subprocess.Popen:
    """One run of the demo's config in a world of one, its output in run_dir.log."""
    args = [sys.executable, os.path.join(ROOT, "scripts", "train_ppo_moe.py"), "--config",
            os.path.join(ROOT, "configs", "demo_distill_cpu.yaml"), f"run_dir={run_dir}", f"seed={seed}",
            f"steps={steps}", f"model.hf_dir={inputs}/model", "model.megatron_dir=null",
            f"data.path={inputs}/train.jsonl", f"teacher.hf_dir={inputs}/teacher",
            f"eval.sets.heldout.path={inputs}/heldout.jsonl", f"eval.every={every}",
            "checkpoint.export_hf=false", *MODES[mode]]
    env = {**os.environ, "PYTHONPATH": ROOT, "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    log = open(run_dir + ".log", "w")
    return subprocess.Popen(args, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)


def finished(run_dir: str) -> dict:
    """held_out(run_dir) of a run that wrote metrics, else {}."""
    return held_out(run_dir) if os.path.exists(os.path.join(run_dir, "metrics.jsonl")) else {}


def held_out(run_dir: str) -> dict:
    """{step: held-out accuracy} of a finished run."""
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    return {row["step"]: row[ACCURACY] for row in rows if ACCURACY in row}


def steps_to(accuracy: dict, target: float):
    """The first evaluated step whose accuracy reaches `target` (None: none does)."""
    return next((step for step, value in sorted(accuracy.items()) if value >= target - 1e-9), None)


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--inputs", help="a folder prepare_demo.py --teacher-steps made")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--every", type=int, default=2)
    parser.add_argument("--rises", default="0.15,0.25,0.35")
    parser.add_argument("--runs", help="the runs' folder (default: a new temporary one)")
    args = parser.parse_args()
    out = json_stdout()
    rises = [float(r) for r in args.rises.split(",")]
    work = args.runs or tempfile.mkdtemp(prefix="bench_distill_")
    os.makedirs(work, exist_ok=True)
    inputs = args.inputs
    if not inputs:
        inputs = os.path.join(work, "inputs")
        subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "prepare_demo.py"), "--out", inputs,
                        "--teacher-steps", "200", "--hf-only"], check=True, cwd=ROOT, stdout=sys.stderr)
    reached = {(mode, rise): [] for mode in MODES for rise in rises}
    for seed in (int(s) for s in args.seeds.split(",")):
        dirs = {mode: os.path.join(work, f"{mode}_{seed}") for mode in MODES}
        procs = {mode: launch(inputs, dirs[mode], seed, args.steps, args.every, mode) for mode in MODES
                 if args.steps not in finished(dirs[mode])}
        for mode, proc in procs.items():
            if proc.wait():
                raise SystemExit(f"the {mode} run of seed {seed} failed: see {dirs[mode]}.log")
        accuracy = {mode: held_out(dirs[mode]) for mode in MODES}
        start = accuracy["distill"][0]
        assert accuracy["reward"][0] == start, accuracy  # the same weights, greedy
        case = {"seed": seed, "at_start": start, "targets": [round(start + rise, 4) for rise in rises]}
        for mode in MODES:
            for rise in rises:
                reached[mode, rise].append(steps_to(accuracy[mode], start + rise))
            case[mode] = {"steps_to_targets": [reached[mode, rise][-1] for rise in rises],
                          "final": accuracy[mode][args.steps], "held_out": accuracy[mode]}
        print(json.dumps(case), file=out)
    # A run that never reached a target counts as past the end, so the median stays an upper bound.
    summary = {f"{mode}_median_steps": [statistics.median(args.steps + 1 if s is None else s
                                                          for s in reached[mode, rise]) for rise in rises]
               for mode in MODES}
    print(json.dumps({"case": "summary", "steps": args.steps, "every": args.every, "rises": rises,
                      **summary, "inputs": inputs, "runs": work}), file=out)


if __name__ == "__main__":
    main()
