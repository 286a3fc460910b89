"""The end-of-run picture: reward, KL, response length, time per phase and the rollout/trainer
mismatch (log-probs; routing and the correction's fractions) against the step, drawn from
metrics.jsonl into curves.png in the run directory."""

import json
import os
from typing import List


def _lines(ax, steps: List[int], rows: List[dict], keys, title: str, log: bool = False,
           missing: float = float("nan")) -> None:
    """One line per key that the run logged, `missing` at the steps that did not log it."""
    for key in keys:
        if any(key in r for r in rows):
            ax.plot(steps, [r.get(key, missing) for r in rows], label=key.split("/", 1)[1])
    if log:
        ax.set_yscale("log")  # from fp32's 1e-7 to bf16's tenths
    ax.set_title(title)
    ax.set_xlabel("step")
    ax.legend(fontsize=7)


def plot_run(run_dir: str) -> str:
    import matplotlib

    matplotlib.use("Agg")  # files only; no display on cluster nodes
    import matplotlib.pyplot as plt

    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        rows: List[dict] = [json.loads(line) for line in f]
    steps = [r["step"] for r in rows]
    fig, axes = plt.subplots(2, 3, figsize=(15, 7))
    panels = [("reward/mean", "reward (mean)"),
              ("kl/actor_to_reference", "KL to reference (algo.kl_estimator)"),
              ("response/length_mean", "response length (tokens)")]
    for ax, (key, title) in zip(axes.flat, panels):
        ax.plot(steps, [r.get(key, float("nan")) for r in rows])
        ax.set_title(title)
        ax.set_xlabel("step")
    phases = sorted({k for r in rows for k in r if k.startswith("time/")})
    _lines(axes.flat[4], steps, rows, phases, "seconds per phase", missing=0.0)
    _lines(axes.flat[3], steps, rows, ("mismatch/logprob_diff_max", "mismatch/logprob_diff_p99",
                                       "mismatch/kl_k3"), "rollout vs trainer log-probs", log=True)
    _lines(axes.flat[5], steps, rows, ("routing/topk_diff_fraction", "correction/masked_fraction",
                                       "correction/truncated_fraction"), "fractions (routing, correction)")
    fig.tight_layout()
    path = os.path.join(run_dir, "curves.png")
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path
