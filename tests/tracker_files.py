"""Reading back what megarl's trackers wrote in a run_dir, each with its own reader: metrics.jsonl,
TensorBoard's EventAccumulator, W&B's `wandb leet inspect --json` on each offline run's .wandb
log, MlflowClient on the SQLite store; and comparing them as {metric: [(step, value), ...]}."""

import glob
import json
import subprocess
import sys

import pytest

from megarl.trainer.trackers import mlflow_key


def series(rows):
    """{metric: [(step, value), ...]} in the order logged."""
    out = {}
    for step, metrics in rows:
        for key, value in metrics.items():
            out.setdefault(key, []).append((step, float(value)))
    return out


def same(got, want, rel=0.0):
    assert got.keys() == want.keys(), sorted(set(got) ^ set(want))
    for key in want:
        assert [s for s, _ in got[key]] == [s for s, _ in want[key]], key
        assert [v for _, v in got[key]] == pytest.approx([v for _, v in want[key]], rel=rel, nan_ok=True), key


def jsonl(run_dir):
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [(row.pop("step"), row) for row in rows]


def tensorboard(run_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def wandb_runs(run_dir):
    """Each offline run's (run record, its history rows as (step, metrics)), by W&B's own reader of
    the .wandb log, in the order the runs started. A log with no run record is left out: W&B
    writes it every 15 s, so a launch killed sooner left only the file's header."""
    runs = []
    for path in glob.glob(str(run_dir / "wandb" / "offline-run-*")):
        out = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", "--json", path],
                             capture_output=True, text=True, check=True).stdout
        records = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
        run = next((r["run"] for r in records if r["type"] == "run"), None)
        if run is None:
            continue
        history = [{k: v for k, v in r["history"]["item"].items() if not k.startswith("_")}
                   for r in records if r["type"] == "history"]
        runs.append((run, [(row.pop("step"), row) for row in history]))
    return sorted(runs, key=lambda found: found[0]["start_time"])  # ISO 8601, to the microsecond


def mlflow_runs(run_dir, project):
    """Each MLflow run of run_dir/mlflow.db: (run, {key: [(step, value)]}), oldest first."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{(run_dir / 'mlflow.db').resolve()}")
    experiment = client.get_experiment_by_name(project)
    runs = sorted(client.search_runs([experiment.experiment_id]), key=lambda run: run.info.start_time)
    return [(run, {key: [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, key)]
                   for key in run.data.metrics}) for run in runs]


def mlflow_names(by_name):
    """{metric: ...} under the names MLflow keeps them by."""
    return {mlflow_key(key): values for key, values in by_name.items()}
