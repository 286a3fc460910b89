"""A reward as a weighted sum of terms: parsing `algo.reward`, combining the terms' scores (failed
terms count, each term logged), the scorer handing each reward model exactly the samples that name
it, and the judge's verdict parsing and config checks. The judge against a real vLLM endpoint and
the reward model against HF are in test_loop.py and test_value_model.py."""

import json

import pytest
import torch

from megarl.plugins.worker_pool import Result
from megarl.rewards.functions import Outcome, Request, RewardTable
from megarl.rewards.judge import Judge, JudgeConfig, question_of, verdict_score
from megarl.rewards.scorer import Scorer, combine
from megarl.rewards.spec import Term, parse_spec


def test_specs_parse_weights_and_kinds():
    spec = parse_spec("math + 0.5*rm:runs/rm + -1e-1 * judge:cfg.yaml")
    assert spec.terms == (Term(1.0, "math"), Term(0.5, "rm:runs/rm"), Term(-0.1, "judge:cfg.yaml"))
    assert spec.functions == ("math", "judge:cfg.yaml") and spec.models == ("runs/rm",)
    assert parse_spec("pkg.mod:fn").terms == (Term(1.0, "pkg.mod:fn"),)
    assert parse_spec("2*path/to/file.py:score").terms == (Term(2.0, "path/to/file.py:score"),)


@pytest.mark.parametrize("text, message", [
    ("", "name a reward"),
    ("math+rm:x", "separate terms with ' \\+ '"),
    ("math + 0.5 rm:x", "is not 'NAME' or 'WEIGHT\\*NAME'"),
    ("math + rm:", "rm:PATH"),
    ("judge:", "judge:CONFIG"),
    ("math + 2*math", "more than once"),
    ("x*math", "is not 'NAME'"),
])
def test_bad_specs_are_named(text, message):
    with pytest.raises(ValueError, match=message):
        parse_spec(text)


def test_a_bad_spec_per_source_is_refused_at_load():
    with pytest.raises(ValueError, match=r"algo.reward_by_source\['gsm8k'\]"):
        RewardTable("math", {"gsm8k": "math + rm:"})
    table = RewardTable("math + 0.5*rm:a", {"x": "exact_match + rm:b", "y": "rm:a"})
    assert table.names == ["exact_match", "math"] and table.models == ["a", "b"]


def test_terms_combine_as_weighted_sums_with_failures_counted():
    specs = [parse_spec("f + 0.5*rm:m"), parse_spec("2*g"), parse_spec("f + -1*g")]
    ok = lambda score, **extras: Result(Outcome(score, extras))  # noqa: E731
    results = {(0, "f"): ok(1.0, acc=1.0), (1, "g"): ok(0.25),
               (2, "f"): Result(None, "boom", timed_out=True), (2, "g"): ok(3.0, acc=0.0)}
    models = {"m": torch.tensor([4.0, float("nan"), float("nan")])}
    scores = combine(specs, results, models, per_term=True)
    assert scores.rewards.tolist() == [3.0, 0.5, -3.0]
    assert scores.failures == 1 and scores.timeouts == 1 and scores.first_error == "boom"
    assert scores.extras["acc"][0] == 1.0 and torch.isnan(scores.extras["acc"][1])
    term = scores.extras["term/rm:m"]
    assert term[0] == 4.0 and torch.isnan(term[1:]).all()
    assert scores.extras["term/g"].tolist()[1:] == [0.25, 3.0]
    assert set(combine(specs, results, models).extras) == {"acc"}  # one-term runs log no terms


def test_each_reward_model_scores_exactly_the_samples_that_name_it():
    seen = {}

    def model(name):
        def score(requests, token_ids):
            seen[name] = ([r.response for r in requests], token_ids)
            return torch.tensor([float(sum(ids)) for ids in token_ids])
        return score

    table = RewardTable("exact_match + 0.5*rm:a", {"b_only": "rm:b", "both": "rm:a + rm:b"})
    requests = [Request("x", "x"), Request("y", "z", "b_only"), Request("w", "w", "both")]
    with pytest.raises(ValueError, match=r"reward models \['b'\] are named by the reward but not loaded"):
        Scorer(table, 0, 1.0, {"a": model("a")})
    scorer = Scorer(table, 0, 1.0, {"a": model("a"), "b": model("b")})
    scores = scorer.score(requests, [[1, 2], [3], [4, 5]])
    scorer.close()
    assert seen == {"a": (["x", "w"], [[1, 2], [4, 5]]), "b": (["y", "w"], [[3], [4, 5]])}
    assert scores.rewards.tolist() == [1.0 + 1.5, 3.0, 9.0 + 9.0]
    assert scores.extras["term/exact_match"][0] == 1.0


def _config(**fields):
    return JudgeConfig(**{"url": "http://127.0.0.1:1/v1", "model": "judge", "template": "{response}",
                          **fields})


def test_verdicts_parse_to_scores():
    numbers = _config(scale=0.1)
    assert verdict_score("Score: 7", numbers) == pytest.approx(0.7)
    assert verdict_score("3, no wait: 8.5", numbers) == pytest.approx(0.85)  # the last one said
    assert verdict_score("no idea", numbers) is None
    labels = _config(pattern=r"\b(CORRECT|INCORRECT)\b", labels={"CORRECT": 1.0, "INCORRECT": 0.0})
    assert verdict_score("It is INCORRECT", labels) == 0.0
    assert verdict_score("Verdict: CORRECT.", labels) == 1.0
    assert verdict_score("Verdict: unsure", labels) is None
    assert question_of([{"role": "system", "content": "s"}, {"role": "user", "content": "q1"},
                        {"role": "assistant", "content": "a"}, {"role": "user", "content": "q2"}]) == "q2"


def test_bad_judge_configs_are_named(tmp_path, monkeypatch):
    monkeypatch.delenv("NO_SUCH_KEY", raising=False)
    with pytest.raises(ValueError, match=r"uses 'answer'; its fields are"):
        _config(template="{answer}")
    with pytest.raises(ValueError, match="api_key_env='NO_SUCH_KEY' is not set"):
        _config(api_key_env="NO_SUCH_KEY")
    path = tmp_path / "judge.yaml"
    path.write_text(json.dumps({"url": "http://x/v1", "model": "m", "temprature": 0}))
    with pytest.raises(ValueError, match=r"unknown keys \['temprature'\], missing keys \['template'\]"):
        Judge.from_file(str(path))
    with pytest.raises(ValueError, match="does not exist"):
        Judge.from_file(str(tmp_path / "missing.yaml"))
