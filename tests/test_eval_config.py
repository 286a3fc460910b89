"""The eval section: its refusals name the key and the fix, a set's reward table, when an
evaluation is due; and the held-out sets as a run loads them (the demo's real tokenizer): missing,
empty and clashing files refused naming the set, max_prompts, one Scorer per distinct reward."""

import pytest
import transformers

from megarl.demo.arithmetic_task import arithmetic_records, train_tokenizer, write_jsonl
from megarl.demo.tiny_checkpoint import make_tiny_checkpoint
from megarl.evaluation.config import EvalConfig, EvalSetConfig
from megarl.evaluation.sets import HeldOut, load_sets
from megarl.planning.config import RunConfig
from megarl.planning.resolved import resolve, resolved_eval
from megarl.planning.typed_config import load
from megarl.rewards.functions import RewardTable
from megarl.rewards.scorer import Scorer


@pytest.mark.parametrize("overrides, message", [
    (["eval.samples=4", "eval.temperature=0.6", "eval.pass_k=[1,8]"],
     r"eval.pass_k=\[1, 8\] holds \[8\], outside \[1, eval.samples=4\].*raise eval.samples or drop"),
    (["eval.pass_k=[]"], r"eval.pass_k is empty"),
    (["eval.samples=4"], r"eval.samples=4 at eval.temperature=0: greedy samples .* eval.samples=1"),
    (["eval.temperature=-1"], r"eval.temperature=-1.0 must be >= 0 \(0: greedy\)"),
    (["eval.top_p=0"], r"eval.top_p=0.0 in \(0, 1\]"),
    (["eval.every=-2"], r"eval.every=-2, .* must be >= 0"),
    (["eval.sets.heldout.paht=x.jsonl"], r"unknown key\(s\) \['paht'\] in eval.sets.heldout; allowed: "
                                          r"\[.*'path'"),
    (["eval.sets.heldout.reward=math"], r"eval.sets.heldout: path is required"),
    (["eval.sets.heldout.path=x.jsonl", "eval.sets.heldout.reward=math+rm"],
     r"eval.sets.heldout: reward='math\+rm': term"),
    (["eval.sets.held/out.path=x.jsonl"], r"eval.sets key 'held/out': .* letters, digits"),
    (["eval.max_new_tokens=100"], r"eval.max_new_tokens=100 exceeds generation.max_new_tokens=64"),
    (["eval.sets.h.path=x.jsonl", "eval.sets.g.path=y.jsonl", "eval.sets.g.reward=math + rm:/rm",
      "layout.rollout_world_size=1"],  # scored on the rollout ranks, the reward model on the trainer's
     r"eval.sets scored by reward models \(rm:\)=g with rollout ranks of their own .*: reward models "
     r"run on the trainer ranks"),
])
def test_bad_eval_settings_are_refused_naming_the_key(overrides, message):
    with pytest.raises(ValueError, match=message):
        load(RunConfig, None, ["model.hf_dir=m", "data.path=d.jsonl", *overrides])


def test_eval_section_from_overrides_with_defaults_resolved():
    config = load(RunConfig, None, [
        "model.hf_dir=m", "data.path=d.jsonl", "eval.sets.heldout.path=h.parquet",
        "eval.sets.mixed.path=m.jsonl", "eval.sets.mixed.reward_by_source={a: math}", "eval.samples=8",
        "eval.temperature=1", "eval.pass_k=[1,8]", "generation.max_new_tokens=32",
        "algo.reward_by_source={b: exact_match}"])
    assert config.eval.pass_k == (1, 8) and config.eval.sets["heldout"].keys.answer == "auto"
    assert config.eval.max_new_tokens == 0 and resolved_eval(config).max_new_tokens == 32
    assert EvalSetConfig(path="p", reward="exact_match").reward_table(config.algo.reward_table) == \
        RewardTable("exact_match")


def test_the_resolved_run_holds_the_budget_and_every_reward_table(tmp_path):
    """resolve: the eval budget (0: generation's), training's reward table then each set's, the
    reward models of all of them, read once from the config and the checkpoint's config.json."""
    hf_dir = tmp_path / "model"
    make_tiny_checkpoint("qwen3", str(hf_dir))
    config = load(RunConfig, None, [
        f"model.hf_dir={hf_dir}", "data.path=d.jsonl", "eval.sets.heldout.path=h.parquet",
        "eval.sets.mixed.path=m.jsonl", "eval.sets.mixed.reward_by_source={a: math}",
        "eval.sets.judged.path=j.jsonl", "eval.sets.judged.reward=rm:/models/rm",
        "generation.max_new_tokens=32", "algo.reward_by_source={b: exact_match}"])
    run = resolve(config)
    training = config.algo.reward_table
    assert run.eval.max_new_tokens == 32 and run.eval.sets == config.eval.sets
    assert run.reward_tables == (training, training, RewardTable("math", {"a": "math"}),
                                 RewardTable("rm:/models/rm"))
    assert run.reward_model_dirs == ("/models/rm",)
    assert run.arch.family == "qwen3" and run.adapters is None and run.engine.adapters is None
    assert run.dims == config.layout.dims() and run.hf_config["model_type"] == "qwen3"


def test_eval_sets_as_a_list_of_files_are_named_after_them():
    """verl's val_files: a list of paths, each set named after its file; two files of one name
    are told apart by their folders; the same file twice is refused naming both."""
    config = load(RunConfig, None, ["model.hf_dir=m", "data.path=d.jsonl",
                                    "eval.sets=[data/gsm8k/test.parquet, data/math/test.parquet, "
                                    "heldout.jsonl]"])
    assert {name: spec.path for name, spec in config.eval.sets.items()} == {
        "gsm8k-test": "data/gsm8k/test.parquet", "math-test": "data/math/test.parquet",
        "heldout": "heldout.jsonl"}
    assert config.eval.sets["heldout"] == EvalSetConfig(path="heldout.jsonl")  # the training reward
    with pytest.raises(ValueError, match=r"eval.sets lists 'a/h.jsonl' and 'a/h.jsonl', both named 'h'; "
                                         r"give the sets as a mapping"):
        load(RunConfig, None, ["model.hf_dir=m", "data.path=d.jsonl", "eval.sets=[a/h.jsonl, a/h.jsonl]"])


def test_evaluations_are_due_every_n_steps_and_after_the_last():
    sets = {"h": EvalSetConfig(path="h.jsonl")}
    assert [s for s in range(1, 8) if EvalConfig(sets=sets, every=3).due_after(s, 7)] == [3, 6, 7]
    assert [s for s in range(1, 8) if EvalConfig(sets=sets).due_after(s, 7)] == [7]
    assert not any(EvalConfig(every=1).due_after(s, 7) for s in range(1, 8))  # no sets


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    root = tmp_path_factory.mktemp("task")
    records = arithmetic_records(40, 9, seed=0)
    train_tokenizer(records, str(root / "tokenizer"))
    return root, records, transformers.AutoTokenizer.from_pretrained(str(root / "tokenizer"))


def test_sets_load_as_data_does_and_bad_ones_are_refused_naming_the_set(task, tmp_path):
    root, records, tokenizer = task
    write_jsonl(records, str(tmp_path / "h.jsonl"))
    (tmp_path / "empty.jsonl").write_text("")
    write_jsonl([{**records[0], "data_source": "a/b"}, {**records[1], "data_source": "a_b"}],
                str(tmp_path / "clash.jsonl"))

    def sets(**paths):
        return {name: EvalSetConfig(path=str(tmp_path / path)) for name, path in paths.items()}

    got = load_sets(EvalConfig(sets=sets(first="h.jsonl", again="h.jsonl"), max_prompts=5), tokenizer, 64,
                    "skip")
    assert [p.answer for p in got["first"]] == [r["answer"] for r in records[:5]] and len(got["again"]) == 5
    assert len(load_sets(EvalConfig(sets=sets(h="h.jsonl")), tokenizer, 64, "skip")["h"]) == 40
    for name, message in (("missing.jsonl", r"eval.sets.s.path='.*missing.jsonl' does not exist"),
                          ("empty.jsonl", r"eval.sets.s: prompt file .*empty.jsonl holds no records"),
                          ("clash.jsonl", r"eval.sets.s: data sources \['a/b', 'a_b'\] would be reported")):
        with pytest.raises((ValueError, FileNotFoundError), match=message):
            load_sets(EvalConfig(sets=sets(s=name)), tokenizer, 64, "skip")
    with pytest.raises(ValueError, match=r"eval.sets.s: .* over data.max_prompt_len=3"):
        load_sets(EvalConfig(sets=sets(s="h.jsonl")), tokenizer, 3, "error")


def test_one_scorer_per_distinct_reward_table(task, tmp_path):
    _, records, tokenizer = task
    write_jsonl(records, str(tmp_path / "h.jsonl"))
    path = str(tmp_path / "h.jsonl")
    training = Scorer(RewardTable("math"), 0, 60.0)
    config = EvalConfig(sets={"same": EvalSetConfig(path=path),
                              "named": EvalSetConfig(path=path, reward="math"),
                              "exact": EvalSetConfig(path=path, reward="exact_match"),
                              "exact_too": EvalSetConfig(path=path, reward="exact_match")})
    made = []

    def make(table):
        made.append(Scorer(table, 0, 60.0))
        return made[-1]

    held_out = HeldOut.load(config, tokenizer, 64, "skip", training, make)
    scorers = held_out.scorers
    assert scorers["same"] is training and scorers["named"] is training
    assert scorers["exact"] is scorers["exact_too"] is made[0] and len(made) == 1
    assert made[0].table == RewardTable("exact_match")
    held_out.close(training)
