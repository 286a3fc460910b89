"""Asynchronous against synchronous training on a workload whose response lengths have a long
tail: tokens/s, idle time per role, and both reward curves.

  python bench/bench_async.py [--quick] [--steps N] [--sft-steps S] [--inputs DIR]

The same model, data and number of samples a step, two placements on this machine's cores:
  sync:  colocated, 2 ranks (torchrun): each rank trains (DP2) and runs an engine, in turn;
  async: 1 trainer rank + 1 rollout rank (layout.rollout_world_size=1), async.max_staleness=1,
         partial rollouts continued across syncs.
The workload is the demo's addition task on a Qwen2-style model warm-started for only S steps
(prepare_demo.py --sft-steps S): most responses are short and a few run to max_new_tokens.
--inputs runs both placements on inputs prepare_demo.py made already (its HF model and prompts).
Both runs use the demo config's PPO (GAE + critic) with IcePop-free decoupled token IS.
Measured from each run's metrics.jsonl over the steps after the first (vLLM's warm-up): a step's
wall time is the sum of its phases (the loop times every phase), tokens/s counts the response
tokens trained. Idle time: the async trainer waits for rollouts in its `generate` phase, the
rollout rank reports its own idle seconds (async/rollout_idle_s); in the sync placement a rank is
never idle, it alternates (its generate and train shares are reported). Prints one JSON object.
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TARGET_SPEEDUP = 1.3


def _run(*args: str, nproc: int = 1) -> None:
    launcher = [] if nproc == 1 else ["-m", "torch.distributed.run", "--standalone",
                                      f"--nproc-per-node={nproc}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # torchrun's default, for both placements alike
    if nproc == 1:
        env.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="29561")
    subprocess.run([sys.executable, *launcher, *args], cwd=ROOT, check=True, stdout=sys.stderr, env=env)


def _rows(run_dir: str) -> list:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def _summary(rows: list, samples_per_step: int) -> dict:
    measured = rows[1:]
    seconds = [sum(v for k, v in r.items() if k.startswith("time/")) for r in measured]
    tokens = [r["response/length_mean"] * samples_per_step for r in measured]
    train = [sum(v for k, v in r.items() if k.startswith("time/") and k != "time/generate") for r in measured]
    out = {"steps_measured": len(measured), "tokens_per_s": sum(tokens) / sum(seconds),
           "step_seconds_median": statistics.median(seconds),
           "response_length_mean": statistics.mean(r["response/length_mean"] for r in rows),
           "response_length_max_median": statistics.median(r["response/length_max"] for r in rows),
           "truncated_fraction": statistics.mean(r["response/truncated"] for r in rows) / samples_per_step,
           "trainer_busy_s": sum(train),
           "trainer_waiting_for_rollouts_s": sum(r["time/generate"] for r in measured),
           "reward_curve": [round(r["reward/mean"], 4) for r in rows]}
    if "async/rollout_generate_s" in rows[0]:
        out.update({f"rollout_{k}": sum(r.get(f"async/rollout_{k}", 0.0) for r in measured)
                    for k in ("generate_s", "sync_s", "idle_s")})
        out.update(version_lag_mean=statistics.mean(r["async/version_lag_mean"] for r in measured),
                   interrupted_requests=measured[-1]["async/interrupted_requests"],
                   mixed_version_samples=sum(r["async/mixed_version_samples"] for r in measured))
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="6 steps instead of --steps")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--sft-steps", type=int, default=1)
    parser.add_argument("--prompts-per-step", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--advantage", default="grpo", help="algo.advantage (grpo: no critic and no KL "
                                                             "reference; gae: the demo's heavier trainer)")
    parser.add_argument("--out", default="runs/bench_async")
    parser.add_argument("--inputs", help="prepare_demo.py's --out folder to use (default: made under "
                                         "--out, a Qwen2-style model warm-started --sft-steps steps)")
    args = parser.parse_args()
    steps = 6 if args.quick else args.steps
    out = os.path.join(ROOT, args.out)
    inputs = args.inputs or os.path.join(out, f"inputs_sft{args.sft_steps}")
    if not args.inputs and not os.path.isfile(os.path.join(inputs, "train.jsonl")):
        _run("scripts/prepare_demo.py", "--out", inputs, "--prompts", "2000", "--model", "qwen2",
             "--sft-steps", str(args.sft_steps), "--hf-only")
    common = ("scripts/train_ppo_moe.py", "--config", "configs/demo_cpu.yaml", f"steps={steps}",
              f"model.hf_dir={os.path.join(inputs, 'model')}", "model.megatron_dir=null",
              f"data.path={os.path.join(inputs, 'train.jsonl')}", "layout.ep=1",
              f"data.prompts_per_step={args.prompts_per_step}",
              f"generation.max_new_tokens={args.max_new_tokens}", 'actor.router_replay="off"',
              "actor.rollout_correction.preset=decoupled_token_is", "checkpoint.every=0",
              "checkpoint.export_hf=false", f"algo.advantage={args.advantage}",
              *(("algo.kl_reward_coeff=0",) if args.advantage != "gae" else ()))
    runs = {"sync": (2, ("layout.world_size=2",)),
            "async": (2, ("layout.world_size=1", "layout.rollout_world_size=1", "async.max_staleness=1"))}
    results = {}
    for name, (nproc, extra) in runs.items():
        run_dir = os.path.join(out, name)
        shutil.rmtree(run_dir, ignore_errors=True)
        _run(*common, f"run_dir={run_dir}", *extra, nproc=nproc)
        results[name] = _summary(_rows(run_dir), args.prompts_per_step * 4)
    speedup = results["async"]["tokens_per_s"] / results["sync"]["tokens_per_s"]
    print(json.dumps({"case": "async_vs_sync_long_tail", "steps": steps, "sft_steps": args.sft_steps,
                      "advantage": args.advantage,
                      "prompts_per_step": args.prompts_per_step, "samples_per_prompt": 4,
                      "max_new_tokens": args.max_new_tokens, "cores": os.cpu_count(), **results,
                      "speedup": speedup, "target_speedup": TARGET_SPEEDUP,
                      "meets_target": speedup >= TARGET_SPEEDUP}))


if __name__ == "__main__":
    main()
