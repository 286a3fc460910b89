"""scripts/evaluate.py's decisions before any engine starts: which model a folder holds, the
settings a run's config.json gives (so the script reproduces the run's numbers), and bad input
refused naming the flag and the fix. Files only, no vLLM (tests/test_loop.py's
test_killed_run_resumes_exactly_and_exports_hf evaluates a run's checkpoint end to end)."""

import json
from dataclasses import asdict

import pytest

from megarl.demo.tiny_checkpoint import BASE, FAMILIES
from megarl.evaluation.model_source import HF, MEGATRON
from megarl.planning.config import RunConfig
from megarl.planning.resolved import resolved_eval
from megarl.planning.typed_config import build
from tests.launch import load_script

script = load_script("evaluate")
HF_CONFIG = {**BASE, **FAMILIES["qwen3"]}


def _hf(folder, tokenizer=True):
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(HF_CONFIG))
    (folder / "model.safetensors").write_bytes(b"")  # only its name is read here
    if tokenizer:
        (folder / "tokenizer.json").write_text("{}")
    return folder


def _megatron(folder, tokenizer=True):
    folder.mkdir(parents=True)
    (folder / "megarl_model.json").write_text(json.dumps({"hf_config": HF_CONFIG}))
    if tokenizer:
        (folder / "hf_assets").mkdir()
        (folder / "hf_assets" / "tokenizer_config.json").write_text("{}")
    return folder


@pytest.fixture
def files(tmp_path):
    data = tmp_path / "held.jsonl"
    data.write_text('{"prompt": "What is 1 + 1?", "answer": "2"}\n')
    run_dir = tmp_path / "run"
    _megatron(run_dir / "checkpoints" / "step_000006" / "actor", tokenizer=False)
    config = build(RunConfig, {
        "seed": 7, "model": {"hf_dir": str(_hf(tmp_path / "base"))}, "data": {"path": "train.jsonl",
                                                                            "max_prompt_len": 32},
        "generation": {"max_new_tokens": 3},
        "eval": {"sets": {"heldout": {"path": str(data), "answer_key": "answer"}}, "samples": 4,
                 "temperature": 1.0, "pass_k": [1, 4]}})
    (run_dir / "config.json").write_text(json.dumps(asdict(config)))
    return {"data": str(data), "run": run_dir, "hf": str(_hf(tmp_path / "model")),
            "step": str(run_dir / "checkpoints" / "step_000006"), "root": tmp_path}


def _plan(*argv):
    return script.make_plan(script.parser().parse_args(argv))


def _refused(*argv) -> str:
    with pytest.raises((ValueError, FileNotFoundError, FileExistsError)) as caught:
        _plan(*argv)
    return str(caught.value)


def test_a_plain_evaluation_takes_the_defaults_and_the_files_stem(files):
    plan = _plan("--model", files["hf"], "--data", files["data"], "--max-prompt-len", "32",
                 "--samples", "8", "--temperature", "0.6", "--pass-k", "1,8")
    assert (plan.model.kind, plan.model.path, plan.tokenizer) == (HF, files["hf"], files["hf"])
    assert plan.set_name == "held" and plan.config.seed == 0
    evaluation = resolved_eval(plan.config)
    assert (evaluation.samples, evaluation.temperature, evaluation.pass_k) == (8, 0.6, (1, 8))
    assert evaluation.max_new_tokens == 64 and plan.config.data.max_prompt_len == 32
    assert plan.config.eval.sets["held"].reward_table(plan.config.algo.reward_table).default == "math"


def test_a_runs_checkpoint_is_evaluated_with_the_runs_settings(files):
    """A trainer checkpoint's actor/ (no tokenizer of its own: the run's model.hf_dir gives it),
    the run's set, seed, sampling and budgets; a flag given overrides the run."""
    plan = _plan("--model", files["step"], "--run-dir", str(files["run"]))
    assert (plan.model.kind, plan.model.path) == (MEGATRON, f"{files['step']}/actor")
    assert plan.tokenizer == str(files["root"] / "base")
    assert plan.set_name == "heldout" and plan.config.seed == 7 and list(plan.config.eval.sets) == ["heldout"]
    evaluation = resolved_eval(plan.config)
    assert (evaluation.samples, evaluation.temperature, evaluation.pass_k, evaluation.max_new_tokens) == \
        (4, 1.0, (1, 4), 3)
    assert plan.config.eval.sets["heldout"].answer_key == "answer"
    plan = _plan("--model", files["step"], "--run-dir", str(files["run"]), "--max-new-tokens", "5",
                 "--reward", "exact_match")
    assert resolved_eval(plan.config).max_new_tokens == 5
    assert plan.config.eval.sets["heldout"].reward == "exact_match"


@pytest.mark.parametrize("argv, message", [
    (("--model", "{root}/nowhere", "--data", "{data}"), "--model '{root}/nowhere' does not exist; give"),
    (("--model", "{data}", "--data", "{data}"), "is a file; give the checkpoint's folder"),
    (("--model", "{root}", "--data", "{data}"), "holds neither kind of checkpoint"),
    (("--model", "{run}", "--data", "{data}"), "is a megarl run's folder, not a model: give its exported"),
    (("--model", "{hf}",), "give --data FILE"),
    (("--model", "{hf}", "--data", "{root}/none.jsonl"), "--data '{root}/none.jsonl' does not exist"),
    (("--model", "{hf}", "--data", "{data}", "--max-prompt-len", "32", "--samples", "4", "--temperature",
      "1", "--pass-k", "1,8"), "--pass-k=[1, 8] holds [8], outside [1, --samples=4]"),
    (("--model", "{hf}", "--data", "{data}", "--max-prompt-len", "32", "--samples", "4"),
     "--samples=4 at --temperature=0: greedy samples"),
    (("--model", "{hf}", "--data", "{data}"), "--max-prompt-len 256 + --max-new-tokens 64 = 320 tokens"),
    (("--model", "{hf}", "--data", "{data}", "--set", "my set"), "--set 'my set': a set's name"),
    (("--model", "{hf}", "--data", "{data}", "--reward-by-source", "gsm8k"), "spell it SOURCE=SPEC"),
    (("--model", "{hf}", "--data", "{data}", "--reward", "math + rm:{root}/rm"), "scores reward functions"),
    (("--model", "{hf}", "--data", "{data}", "--reward", "no_such_reward"), "no_such_reward"),
    (("--model", "{hf}", "--data", "{data}", "--convert-dir", "{root}/out"), "drop --convert-dir"),
    (("--model", "{step}", "--run-dir", "{run}", "--convert-dir", "{root}"), "already exists; remove it"),
    (("--model", "{hf}", "--run-dir", "{root}"), "has no config.json"),
    (("--model", "{hf}", "--run-dir", "{run}", "--set", "other"), "evaluates ['heldout']; pick one"),
])
def test_bad_input_is_refused_naming_the_flag_and_the_fix(files, argv, message):
    values = {k: str(v) for k, v in files.items()}
    assert message.format(**values) in _refused(*(a.format(**values) for a in argv))


def test_a_checkpoint_without_a_tokenizer_needs_one(files):
    bare = str(_megatron(files["root"] / "bare", tokenizer=False))
    argv = ("--model", bare, "--data", files["data"], "--max-prompt-len", "32")
    assert "pass --tokenizer DIR" in _refused(*argv)
    plan = _plan(*argv, "--tokenizer", files["hf"])
    assert plan.tokenizer == files["hf"] and plan.model.kind == MEGATRON


def test_the_table_has_a_row_per_source_and_the_whole_set_last():
    metrics = {f"eval/s/{source}/{metric}": value for source, value in (("b", 0.25), ("all", 0.5), ("a", 1.0))
               for metric in ("truncation_rate", "pass@8", "reward_mean", "pass@1", "accuracy",
                              "response_len_mean")}
    header, *rows = script.table(metrics, "s").split("\n")
    assert header.split() == ["source", "reward_mean", "accuracy", "pass@1", "pass@8", "response_len_mean",
                              "truncation_rate"]
    assert [row.split()[0] for row in rows] == ["a", "b", "all"]
    assert rows[1].split()[1:] == ["0.2500"] * 6
