"""Typed config: YAML + dotted overrides onto the real actor config tree, with clear errors."""

import dataclasses
from dataclasses import dataclass, field
from typing import Dict

import pytest
import yaml

from megarl.actor.config import ActorConfig
from megarl.planning.typed_config import build, load


@dataclass(frozen=True)
class Run:
    name: str = "demo"
    steps: int = 10
    actor: ActorConfig = field(default_factory=ActorConfig)
    by_source: Dict[str, float] = field(default_factory=dict)


def test_yaml_then_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"steps": 3, "actor": {"policy_loss": "gspo",
                                                          "optim": {"lr": 1e-5}}}))
    config = load(Run, str(path), ["actor.optim.lr=2e-6", "actor.batching.micro_batch_tokens=4096",
                                   "actor.dual_clip=3", "name=x"])
    assert config.steps == 3 and config.name == "x"
    assert config.actor.policy_loss == "gspo" and config.actor.optim.lr == 2e-6
    assert config.actor.batching.micro_batch_tokens == 4096
    assert config.actor.dual_clip == 3.0 and isinstance(config.actor.dual_clip, float)
    assert build(Run, dataclasses.asdict(config)) == config


def test_mappings_from_yaml_and_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"by_source": {"openai/gsm8k": 1, "lighteval/MATH": 0.5}}))
    assert load(Run, str(path)).by_source == {"openai/gsm8k": 1.0, "lighteval/MATH": 0.5}
    assert load(Run, None, ["by_source={a: 2, b: 3e-1}"]).by_source == {"a": 2.0, "b": 0.3}


def test_rollout_correction_by_preset_or_by_fields():
    icepop = load(Run, None, ["actor.rollout_correction.preset=icepop"]).actor.rollout_correction
    assert (icepop.correction.weights, icepop.correction.reject, icepop.correction.bounds) == \
        ("token", "token", (0.5, 5.0))
    fields = ["preset=null", "weights=sequence", "cap=3", "reject=geometric", "high=1.01"]
    own = load(Run, None, [f"actor.rollout_correction.{f}" for f in fields]).actor.rollout_correction
    own = own.correction
    assert (own.weights, own.cap, own.reject, own.bounds) == ("sequence", 3.0, "geometric", (1 / 1.01, 1.01))
    assert load(Run, None, ["actor.router_replay='off'"]).actor.router_replay == "off"


@dataclass(frozen=True)
class Switches:
    flag: bool = False
    mode: str = "on"


@pytest.mark.parametrize("word", ["off", "on", "yes", "no", "Off", "NO"])
def test_on_off_words_stay_words_in_files_and_overrides(tmp_path, word):
    """YAML 1.1 reads on/off/yes/no as booleans; a person typing actor.router_replay=off means the
    word, in a file as on the command line. A bool field takes the same words as a person means them."""
    as_bool = word.lower() in ("on", "yes")
    assert load(Run, None, ["actor.router_replay=off"]).actor.router_replay == "off"
    path = tmp_path / "c.yaml"
    path.write_text(f"mode: {word}\nflag: {word}\n")
    assert load(Switches, str(path)) == Switches(flag=as_bool, mode=word)
    assert load(Switches, None, [f"mode={word}", f"flag={word}"]) == Switches(flag=as_bool, mode=word)
    assert load(Switches, None, ["flag=true"]).flag and not load(Switches, None, ["flag=FALSE"]).flag


@pytest.mark.parametrize("overrides,message", [
    (["actor.optim.lrr=1"], r"unknown key\(s\) \['lrr'\] in actor.optim; allowed: \[.*'lr'"),
    (["steps=many"], r"steps must be int, got 'many'"),
    (["actor.policy_loss=ppo3"], r"actor: unknown policy_loss 'ppo3'; choose one of"),
    (["actor.optim.lr_decay_style=cosine"], r"actor.optim: lr_decay_style='cosine' needs lr_decay_steps"),
    (["actor=3"], r"actor must be a section"),
    (["steps"], r"must look like key.sub=value"),
    (["by_source=math"], r"by_source must be a mapping, got 'math'"),
    (["by_source={a: x}"], r"by_source.a must be a number, got 'x'"),
    (["actor.router_replay=False"], r"actor.router_replay must be str, got False"),
    (["actor.router_replay=rollout_engine"], r"router_replay='rollout_engine': choose one of "
                                             r"\['off', 'old', 'rollout'\]"),
    (["actor.rollout_correction.preset=mis"], r"unknown actor.rollout_correction.preset 'mis'"),
    (["actor.rollout_correction.cap=3"], r"preset 'off' sets the fields, but \['cap'\] are given"),
    (["actor.rollout_correction.preset=null", "actor.rollout_correction.reject=token"],
     r"reject='token' needs high"),
])
def test_errors_name_the_key(overrides, message):
    with pytest.raises(ValueError, match=message):
        load(Run, None, overrides)
