"""Per-step observability of a run: phase timers, metrics.jsonl, the trackers logger.trackers
chooses (TensorBoard, W&B, MLflow: trackers.py), a progress bar.

Owns writing (rank 0 only) and timing; the loop decides what to measure, console.py where the
bar and lines are drawn.
"""

import contextlib
import json
import os
import time
from typing import Dict, List, Optional, Tuple

from megarl.planning.config import LoggerConfig
from megarl.trainer import console
from megarl.trainer.trackers import TRACKERS


class PhaseTimer:
    def __init__(self):
        self.seconds: Dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, phase: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - start

    def move(self, source: str, target: str, seconds: float) -> None:
        """Book `seconds` timed under `source` under `target` instead: a call timed as one phase
        may run part of another inside it (the colocated weight sync runs within generate's
        memory handoff), and each phase's time should be its own."""
        if not 0 <= seconds <= self.seconds.get(source, 0.0):
            raise ValueError(f"cannot move {seconds} s from phase {source!r}, which timed "
                             f"{self.seconds.get(source, 0.0)} s: the moved part must lie within it")
        if seconds:
            self.seconds[source] -= seconds
            self.seconds[target] = self.seconds.get(target, 0.0) + seconds


def _drop_steps_from(path: str, first_step: int) -> None:
    """A resumed run repeats the steps after its checkpoint: forget what was logged for them."""
    if not os.path.isfile(path):
        return
    with open(path) as f:
        kept = [line for line in f if json.loads(line)["step"] < first_step]
    with open(path, "w") as f:
        f.writelines(kept)


class MetricsLog:
    """metrics.jsonl in run_dir, the same rows to each tracker of `logger` (TensorBoard alone by
    default, None), and the console's bar with reward and ETA. `settings`: the run's configuration,
    which W&B and MLflow keep beside the metrics."""

    def __init__(self, run_dir: str, total_steps: int, first_step: int, enabled: bool,
                 logger: Optional[LoggerConfig] = None, settings: Optional[dict] = None):
        self.enabled = enabled
        logger = logger or LoggerConfig()
        if not enabled:
            return
        os.makedirs(run_dir, exist_ok=True)
        self.path = os.path.join(run_dir, "metrics.jsonl")
        _drop_steps_from(self.path, first_step)
        self.trackers = [TRACKERS[name](run_dir, first_step, logger, settings) for name in logger.trackers]
        console.start_bar(total_steps, first_step - 1)

    def log(self, step: int, metrics: Dict[str, float], trained: bool = True) -> None:
        """One row of metrics.jsonl and of each tracker at `step`; `trained`: the row of a
        training step, which advances the bar (False: a row of evaluation metrics only, the
        at-start evaluation's at step 0)."""
        if not self.enabled:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps({"step": step, **metrics}) + "\n")
        for tracker in self.trackers:
            tracker.log(step, metrics)
        if not trained:
            return
        skipped = {k: v for k, v in metrics.items() if k.endswith("/skipped") and v}
        if skipped:
            console.say(f"megarl: step {step}: optimizer steps skipped for non-finite loss or "
                        f"gradients (fraction per model: {skipped}); the weights were not changed")
        console.advance(reward=f"{metrics['reward/mean']:.3f}")

    def _rows(self) -> List[dict]:
        with open(self.path) as f:
            return [json.loads(line) for line in f]

    def reward_window(self, first: bool) -> float:
        """Mean reward over the first (or last) 10% of the steps logged (at least one)."""
        rewards = [row["reward/mean"] for row in self._rows() if "reward/mean" in row]
        k = max(1, len(rewards) // 10)
        window = rewards[:k] if first else rewards[-k:]
        return sum(window) / len(window)

    def evaluations(self) -> List[Tuple[int, Dict[str, float]]]:
        """(step, its evaluation metrics) of every row holding some, in step order."""
        found = [(row["step"], {k: v for k, v in row.items() if k.startswith("eval/")})
                 for row in self._rows()]
        # Sorted: rollout ranks of their own finish evaluations while later steps are logged.
        return sorted(((step, metrics) for step, metrics in found if metrics), key=lambda found: found[0])

    def where(self) -> str:
        """Where the metrics are: metrics.jsonl and each tracker's files or run."""
        return "; ".join([f"metrics in {self.path}", *(tracker.where() for tracker in self.trackers)])

    def close(self) -> None:
        if self.enabled:
            console.end_bar()
            for tracker in self.trackers:
                tracker.close()
