"""The end-of-run picture: reward, KL, response length, time per phase and the rollout/trainer
mismatch (log-probs; routing and the correction's fractions) against the step, and with held-out
sets their accuracy, pass@k and mean reward at the steps evaluated, drawn from metrics.jsonl into
curves.png in the run directory."""

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


def _held_out(whole, by_source, rows: List[dict]) -> None:
    """Each set's whole-set accuracy, pass@k and mean reward, and each data source's accuracy, at
    the steps evaluated (points joined: the steps between were not measured)."""
    steps = [r["step"] for r in rows]
    keys = sorted({k for r in rows for k in r if k.startswith("eval/")})
    sets = [k for k in keys if k.split("/")[2] == "all"
            and (k.endswith(("/accuracy", "/reward_mean")) or "/pass@" in k)]
    sources = [k for k in keys if k.split("/")[2] != "all" and k.endswith("/accuracy")]
    for ax, chosen, title in ((whole, sets, "held-out sets (eval.sets)"),
                              (by_source, sources, "held-out accuracy per data source")):
        for key in chosen:
            _, name, source, metric = key.split("/")
            label = f"{name} {metric}" if source == "all" else f"{name} {source}"
            ax.plot(steps, [r.get(key, float("nan")) for r in rows], marker="o", label=label)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.legend(fontsize=7)


def plot_run(run_dir: str) -> str:
    import matplotlib

    matplotlib.use("Agg")  # files only; no display on cluster nodes
    import matplotlib.pyplot as plt

    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        logged: List[dict] = [json.loads(line) for line in f]
    rows = [r for r in logged if "reward/mean" in r]  # the steps' rows (not the at-start evaluation's)
    steps = [r["step"] for r in rows]
    evaluated = sorted((r for r in logged if any(k.startswith("eval/") for k in r)),
                       key=lambda r: r["step"])  # rollout ranks of their own log them late
    fig, axes = plt.subplots(2, 4 if evaluated else 3, figsize=(20 if evaluated else 15, 7))
    panels = [("reward/mean", "reward (mean)"),
              ("kl/actor_to_reference", "KL to reference (algo.kl_estimator)"),
              ("response/length_mean", "response length (tokens)")]
    for ax, (key, title) in zip(axes[0], panels):
        ax.plot(steps, [r.get(key, float("nan")) for r in rows])
        ax.set_title(title)
        ax.set_xlabel("step")
    phases = sorted({k for r in rows for k in r if k.startswith("time/")})
    _lines(axes[1, 1], steps, rows, phases, "seconds per phase", missing=0.0)
    _lines(axes[1, 0], steps, rows, ("mismatch/logprob_diff_max", "mismatch/logprob_diff_p99",
                                     "mismatch/kl_k3"), "rollout vs trainer log-probs", log=True)
    _lines(axes[1, 2], steps, rows, ("routing/topk_diff_fraction", "correction/masked_fraction",
                                     "correction/truncated_fraction"), "fractions (routing, correction)")
    if evaluated:
        _held_out(axes[0, 3], axes[1, 3], evaluated)
    # Fixed margins, not tight_layout: its text-extent passes were half the drawing's time (~0.5 s of
    # a core at the end of every run, measured on a 2-step run's metrics), and every panel's
    # labels fit these.
    fig.subplots_adjust(left=0.04, right=0.99, bottom=0.07, top=0.95, wspace=0.2, hspace=0.3)
    path = os.path.join(run_dir, "curves.png")
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path
