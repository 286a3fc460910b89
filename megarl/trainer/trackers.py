"""The experiment trackers a run's metrics go to beside metrics.jsonl: TensorBoard, Weights &
Biases and MLflow, each a small class with the same three calls (open with the run, log one row,
close), chosen by name from logger.trackers (planning/config.py's LoggerConfig).

Every tracker gets metrics.jsonl's rows: the same names and values at the same step. The one
exception is MLflow, which refuses some characters in a name (`pass@1`): mlflow_key spells them
its way. A resumed run repeats the steps after its checkpoint; each tracker's answer to that is
in its class (docs/tracking.md).
Does not own metrics.jsonl, the bar or what is measured (metrics.py, the loop).
"""

import os
import re
import time
from typing import Dict, Optional

from megarl.planning.config import LoggerConfig


def run_name(run_dir: str, logger: LoggerConfig, first_step: int) -> str:
    """logger.name or run_dir's folder name; a resumed launch's run is its own, named for the
    step it starts at."""
    name = logger.name or os.path.basename(os.path.normpath(os.path.abspath(run_dir)))
    return name if first_step <= 1 else f"{name}-from-step-{first_step}"


class TensorBoard:
    """run_dir/tensorboard. On resume, purge_step=first_step makes TensorBoard's readers drop the
    events an earlier launch wrote at or past that step (a killed run's steps after its last
    checkpoint): one curve, as if the run had never stopped."""

    def __init__(self, run_dir: str, first_step: int, logger: LoggerConfig, settings: Optional[dict]):
        from torch.utils.tensorboard import SummaryWriter

        self.dir = os.path.join(run_dir, "tensorboard")
        self.writer = SummaryWriter(self.dir, purge_step=first_step)

    def log(self, step: int, metrics: Dict[str, float]) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def where(self) -> str:
        return f"TensorBoard: tensorboard --logdir {self.dir}"

    def close(self) -> None:
        self.writer.close()


class WandB:
    """A W&B run in run_dir/wandb, offline unless WANDB_MODE says otherwise (then WANDB_API_KEY
    and the network are the user's). Each row is logged with its `step` as a metric and the x-axis
    of every other: rollout ranks of their own finish evaluations after later steps were logged,
    and W&B drops a row whose own step goes back. On resume the launch is a run of its own in the
    same group (run_name): W&B cannot take back what an offline run wrote, so the earlier run keeps
    the steps it logged past its checkpoint."""

    def __init__(self, run_dir: str, first_step: int, logger: LoggerConfig, settings: Optional[dict]):
        import wandb

        self.mode = os.environ.get("WANDB_MODE", "offline")
        self.run = wandb.init(dir=run_dir, project=logger.project, name=run_name(run_dir, logger, first_step),
                              group=run_name(run_dir, logger, 1), mode=self.mode, config=settings,
                              # megarl owns the terminal and run_dir/logs; W&B would wrap stdout
                              settings=wandb.Settings(console="off", quiet=True))
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")

    def log(self, step: int, metrics: Dict[str, float]) -> None:
        self.run.log({"step": step, **metrics})

    def where(self) -> str:
        if self.mode == "offline":
            return f"W&B (offline): wandb sync {self.run.settings.sync_dir}"
        return f"W&B: {self.run.url}"

    def close(self) -> None:
        self.run.finish()


_MLFLOW_REFUSED = re.compile(r"[^/\w.\- :]")


def mlflow_key(name: str) -> str:
    """Pure: `name` as MLflow takes it: MLflow allows letters, digits and `_-. :/` only, so `@` is
    spelled `_at_` (pass@1 -> pass_at_1) and any other refused character `_`."""
    return _MLFLOW_REFUSED.sub("_", name.replace("@", "_at_"))


def _flat(settings: dict, prefix: str = "") -> Dict[str, str]:
    """Nested settings -> {dotted key: its value as text}, MLflow's params."""
    out = {}
    for key, value in settings.items():
        if isinstance(value, dict) and value:
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = str(value)
    return out


class MLflow:
    """An MLflow run in experiment logger.project at logger.mlflow_uri, by default a SQLite store,
    run_dir/mlflow.db: MLflow's file store keeps each metric in a file named by it, so a name
    cannot also be the folder of others (throughput/tflops_per_device beside
    throughput/tflops_per_device/generate), and MLflow 3.17 keeps it in maintenance mode. On
    resume the launch is a run of its own, tagged megarl.group with the first launch's name:
    MLflow keeps every value logged, so one run would hold the repeated steps twice."""

    BATCH = 1000  # MLflow's most metrics per log_batch
    PARAMS = 100  # and params

    def __init__(self, run_dir: str, first_step: int, logger: LoggerConfig, settings: Optional[dict]):
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        self.uri = logger.mlflow_uri or f"sqlite:///{os.path.abspath(os.path.join(run_dir, 'mlflow.db'))}"
        self.client = MlflowClient(tracking_uri=self.uri)
        experiment = self.client.get_experiment_by_name(logger.project)
        experiment_id = (experiment.experiment_id if experiment
                         else self.client.create_experiment(logger.project))
        self.run_id = self.client.create_run(
            experiment_id, run_name=run_name(run_dir, logger, first_step),
            tags={"megarl.group": run_name(run_dir, logger, 1), "megarl.first_step": str(first_step),
                  "megarl.run_dir": os.path.abspath(run_dir)}).info.run_id
        self.keys: Dict[str, str] = {}  # MLflow's key -> the metric's name, to refuse two in one
        params = [Param(mlflow_key(key), value[:6000]) for key, value in _flat(settings or {}).items()]
        for start in range(0, len(params), self.PARAMS):
            self.client.log_batch(self.run_id, params=params[start:start + self.PARAMS])

    def _key(self, name: str) -> str:
        key = mlflow_key(name)
        if self.keys.setdefault(key, name) != name:
            raise ValueError(f"metrics {self.keys[key]!r} and {name!r} would both be MLflow's {key!r}; "
                             "rename one, or take mlflow out of logger.trackers")
        return key

    def log(self, step: int, metrics: Dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        rows = [Metric(self._key(name), float(value), now, step) for name, value in metrics.items()]
        for start in range(0, len(rows), self.BATCH):
            self.client.log_batch(self.run_id, metrics=rows[start:start + self.BATCH])

    def where(self) -> str:
        return f"MLflow: run {self.run_id} at {self.uri}"

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


TRACKERS = {"tensorboard": TensorBoard, "wandb": WandB, "mlflow": MLflow}
