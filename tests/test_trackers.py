"""The trackers of logger.trackers, real packages writing real files: a few rows through MetricsLog
to TensorBoard, W&B (offline) and MLflow (SQLite), read back with each one's own reader (
TensorBoard's EventAccumulator, `wandb leet inspect --json` on the .wandb log, MlflowClient on the
store) and compared with metrics.jsonl; a resumed launch; a tracker whose package does not import,
refused by preflight before anything is loaded; the pins preflight names against setup.py and
the locks."""

import ast
import math
import pathlib
import subprocess
import sys

import pytest

from megarl.planning.config import TRACKER_PACKAGES, LoggerConfig
from megarl.trainer.metrics import MetricsLog
from megarl.trainer.trackers import mlflow_key
from tests.tracker_files import jsonl, mlflow_names, mlflow_runs, same, series, tensorboard, wandb_runs

ROOT = pathlib.Path(__file__).resolve().parents[1]
ALL = LoggerConfig(trackers=("tensorboard", "wandb", "mlflow"), project="megarl-test", name="tiny")
SETTINGS = {"algo": {"advantage": "grpo", "kl_clamp": None}, "eval": {"sets": {"math@small": {"every": 2}}}}
EVAL = "eval/math/all/pass@1"
# (step, metrics, trained): the at-start evaluation's row, three steps, and an evaluation rollout
# ranks of their own finished after step 2 was logged (its step goes back); a count, a NaN.
FIRST = [(0, {EVAL: 0.5, "eval/math/all/accuracy": 0.25}, False),
         (1, {"reward/mean": 0.25, "reward/failures": 0, "time/generate": 1.5}, True),
         (2, {"reward/mean": 0.75, "reward/failures": 2, "time/generate": 1.25,
              "mismatch/kl_k1": math.nan}, True),
         (1, {EVAL: 0.75, "eval/math/all/accuracy": 0.5}, False),
         (3, {"reward/mean": 0.5, "reward/failures": 1, "time/generate": 1.0}, True)]
# the launch resumed from step 2's checkpoint: steps 3 and 4 again, with other values
RESUMED = [(3, {"reward/mean": 0.625, "reward/failures": 0, "time/generate": 2.0}, True),
           (4, {"reward/mean": 0.875, "reward/failures": 0, "time/generate": 2.5}, True)]


def _launch(run_dir, first_step, rows):
    log = MetricsLog(str(run_dir), total_steps=4, first_step=first_step, enabled=True, logger=ALL,
                     settings=SETTINGS)
    for step, metrics, trained in rows:
        log.log(step, metrics, trained)
    where = log.where()
    log.close()
    return where


def test_each_tracker_holds_metrics_jsonl_rows_and_a_resume_is_told_apart(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_MODE", raising=False)  # offline, the default
    run_dir = tmp_path / "run"
    where = _launch(run_dir, 1, FIRST)
    logged = jsonl(run_dir)
    want = series(logged)
    same(want, series([(step, metrics) for step, metrics, _ in FIRST]))
    same(tensorboard(run_dir), want, rel=1e-7)  # float32 events
    [(run, history)] = wandb_runs(run_dir)
    assert (run["display_name"], run["run_group"], run["project"]) == ("tiny", "tiny", "megarl-test")
    assert run["config"]["update"]["algo"] == SETTINGS["algo"]  # the run's configuration beside it
    same(series(history), want)
    [(run, by_key)] = mlflow_runs(run_dir, ALL.project)
    assert run.info.run_name == "tiny" and run.info.status == "FINISHED"
    params = run.data.params  # the run's configuration, dotted, with MLflow's spelling of keys
    assert params["algo.advantage"] == "grpo" and params["eval.sets.math_at_small.every"] == "2"
    assert "eval/math/all/pass_at_1" in by_key
    same(by_key, mlflow_names(want))
    assert f"wandb sync {run_dir}/wandb/offline-run-" in where and "MLflow: run" in where

    # Resumed from step 2's checkpoint: metrics.jsonl and TensorBoard drop the first launch's step 3
    # (purge_step); W&B and MLflow start a run of their own for the launch, the first keeping its rows.
    _launch(run_dir, 3, RESUMED)
    logged = jsonl(run_dir)
    assert [step for step, _ in logged] == [0, 1, 2, 1, 3, 4]
    want = series(logged)
    same(tensorboard(run_dir), want, rel=1e-7)
    (_, first), (run, history) = wandb_runs(run_dir)
    assert (run["display_name"], run["run_group"]) == ("tiny-from-step-3", "tiny")
    same(series(first), series([(step, metrics) for step, metrics, _ in FIRST]))
    same(series(history), series([(step, metrics) for step, metrics, _ in RESUMED]))
    (_, first), (run, by_key) = mlflow_runs(run_dir, ALL.project)
    assert run.info.run_name == "tiny-from-step-3"
    assert run.data.tags["megarl.group"] == "tiny" and run.data.tags["megarl.first_step"] == "3"
    same(by_key, series([(step, metrics) for step, metrics, _ in RESUMED]))
    assert first["reward/mean"] == [(1, 0.25), (2, 0.75), (3, 0.5)]  # the first launch's run, whole


def test_mlflow_keys_spell_refused_characters_its_way():
    assert mlflow_key("eval/math/openai_gsm8k/pass@8") == "eval/math/openai_gsm8k/pass_at_8"
    assert mlflow_key("reward/format ok?_mean") == "reward/format ok__mean"
    assert mlflow_key("time/generate") == "time/generate"


def test_a_tracker_that_does_not_import_is_refused_first_naming_the_install():
    """Each package hidden from the import system (as if not installed): preflight refuses the run
    before it reads the model (whose folder does not exist), naming the pinned install and the key."""
    code = ("import sys; sys.modules['wandb'] = sys.modules['mlflow'] = None\n"
            "from megarl.planning.config import RunConfig\n"
            "from megarl.planning.preflight import preflight\n"
            "from megarl.planning.typed_config import load\n"
            "for name in ('wandb', 'mlflow'):\n"
            "    try:\n"
            "        preflight(load(RunConfig, overrides=['model.hf_dir=/nonexistent',"
            " 'data.path=/nonexistent', f'logger.trackers=[tensorboard,{name}]']))\n"
            "    except ValueError as error:\n"
            "        print(error)\n")
    said = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                          check=True).stdout.strip().splitlines()
    assert len(said) == 2, said
    for name, line in zip(("wandb", "mlflow"), said):
        assert line.startswith(f"logger.trackers has {name!r}, but {name!r} does not import here"), line
        assert f"pip install {TRACKER_PACKAGES[name][1]}" in line and "out of logger.trackers" in line, line


def test_unknown_or_repeated_trackers_are_refused():
    named = r"logger.trackers=.*give each of \['mlflow', 'tensorboard', 'wandb'\] at most once"
    for trackers in (("tensorboard", "neptune"), ("wandb", "wandb")):
        with pytest.raises(ValueError, match=named):
            LoggerConfig(trackers=trackers)
    LoggerConfig(trackers=())  # metrics.jsonl alone


def test_the_named_installs_are_the_pinned_ones():
    tree = ast.parse((ROOT / "setup.py").read_text())
    call = next(node for node in ast.walk(tree) if isinstance(node, ast.Call)
                and getattr(node.func, "id", None) == "setup")
    required = ast.literal_eval(next(k.value for k in call.keywords if k.arg == "install_requires"))
    for lock in ("cpu-lock.txt", "cuda-lock.txt"):
        pins = set((ROOT / "requirements" / lock).read_text().lower().replace("===", "==").splitlines())
        for _, package in TRACKER_PACKAGES.values():
            assert package in required, package
            assert package.lower() in pins, (lock, package)
