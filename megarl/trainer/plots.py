"""The end-of-run picture: reward, KL, response length and time per phase against the step,
drawn from metrics.jsonl into curves.png in the run directory."""

import json
import os
from typing import List


def plot_run(run_dir: str) -> str:
    import matplotlib

    matplotlib.use("Agg")  # files only; no display on cluster nodes
    import matplotlib.pyplot as plt

    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        rows: List[dict] = [json.loads(line) for line in f]
    steps = [r["step"] for r in rows]
    fig, axes = plt.subplots(2, 2, figsize=(11, 7))
    panels = [("reward/mean", "reward (mean)"),
              ("kl/actor_to_reference", "KL to reference (algo.kl_estimator)"),
              ("response/length_mean", "response length (tokens)")]
    for ax, (key, title) in zip(axes.flat, panels):
        ax.plot(steps, [r.get(key, float("nan")) for r in rows])
        ax.set_title(title)
        ax.set_xlabel("step")
    phases = sorted({k for r in rows for k in r if k.startswith("time/")})
    ax = axes.flat[3]
    for key in phases:
        ax.plot(steps, [r.get(key, 0.0) for r in rows], label=key[len("time/"):])
    ax.set_title("seconds per phase")
    ax.set_xlabel("step")
    ax.legend(fontsize=7)
    fig.tight_layout()
    path = os.path.join(run_dir, "curves.png")
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path
