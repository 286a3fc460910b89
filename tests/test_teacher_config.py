"""The teacher: section and algo.distill refused before any process starts, each with a message
naming the values and the fix: from the config alone (a coefficient without a teacher and the
reverse, a negative coefficient, a URL beside serve, serve without a checkpoint), and by preflight
against the checkpoints (a teacher folder that does not exist, a vocabulary of another size, a
tokenizer of the same size whose tokens differ)."""

import json
import os
import shutil

import pytest

from megarl.planning.config import RunConfig
from megarl.planning.preflight import preflight
from megarl.planning.typed_config import load
from tests.launch import ROOT

CONFIG = os.path.join(ROOT, "configs/demo_cpu.yaml")


@pytest.mark.parametrize("overrides,message", [
    (["algo.distill.coeff=0.5"],
     r"algo.distill.coeff=0.5 with teacher.hf_dir='' and teacher.url='': distillation needs both"),
    (["teacher.hf_dir=/some/teacher"],
     r"algo.distill.coeff=0.0 with teacher.hf_dir='/some/teacher' .*set both, or neither"),
    (["teacher.hf_dir=/some/teacher", "algo.distill.coeff=-0.1"],
     r"algo.distill.coeff=-0.1 must be >= 0 \(0 turns distillation off\)"),
    (["teacher.url=http://127.0.0.1:8000/v1", "teacher.serve=true", "teacher.hf_dir=/t",
      "algo.distill.coeff=1"],
     r"teacher.url='http://127.0.0.1:8000/v1' with teacher.serve=true: give the URL .* not both"),
    (["teacher.serve=true", "algo.distill.coeff=1"], r"teacher.serve=true needs teacher.hf_dir"),
])
def test_the_config_refuses_inconsistent_distillation(overrides, message):
    with pytest.raises(ValueError, match=message):
        load(RunConfig, CONFIG, overrides)


@pytest.fixture(scope="module")
def student(tmp_path_factory):
    """A one-layer Qwen3 of the demo's 48-token tokenizer: config.json, weights and tokenizer."""
    from megarl.demo.arithmetic_task import arithmetic_records, train_tokenizer
    from megarl.demo.tiny_checkpoint import make_named

    out = str(tmp_path_factory.mktemp("student"))
    make_named("qwen3", out, vocab_size=48, num_hidden_layers=1)
    train_tokenizer(arithmetic_records(50, 9, 0), out)
    return out


def _teacher_like(student, out, vocab_size=None, rename=None):
    """The student's config.json and tokenizer files in `out`, with config.json's vocab_size, or
    one token of the tokenizer (rename: (old, new)), changed."""
    os.makedirs(out)
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(student, name), os.path.join(out, name))
    if vocab_size is not None:
        with open(os.path.join(out, "config.json")) as f:
            config = json.load(f)
        with open(os.path.join(out, "config.json"), "w") as f:
            json.dump({**config, "vocab_size": vocab_size}, f)
    if rename is not None:
        path = os.path.join(out, "tokenizer.json")
        with open(path) as f:
            text = f.read()
        old, new = (json.dumps(piece) for piece in rename)
        assert text.count(old) >= 1 and new not in text
        with open(path, "w") as f:
            f.write(text.replace(old, new))
    return out


def _refusal(student, teacher) -> str:
    config = load(RunConfig, CONFIG, [f"model.hf_dir={student}", "model.megatron_dir=null",
                                      "layout.world_size=1", "layout.ep=1", "actor.router_replay=off",
                                      f"teacher.hf_dir={teacher}", "algo.distill.coeff=1.0"])
    with pytest.raises(ValueError) as refused:
        preflight(config)
    return str(refused.value)


def test_a_missing_teacher_folder_is_refused(student, tmp_path):
    message = _refusal(student, tmp_path / "no_such_teacher")
    assert f"teacher.hf_dir='{tmp_path / 'no_such_teacher'}' is not a folder" in message


def test_a_vocabulary_of_another_size_is_refused_naming_both(student, tmp_path):
    teacher = _teacher_like(student, str(tmp_path / "teacher"), vocab_size=64)
    message = _refusal(student, teacher)
    assert f"{teacher!r}: vocab_size 64" in message and f"{student!r}: vocab_size 48" in message, message
    assert "share the student's tokenizer and vocabulary" in message


def test_a_tokenizer_of_the_same_size_with_other_tokens_is_refused_naming_both(student, tmp_path):
    import transformers

    pieces = sorted(transformers.AutoTokenizer.from_pretrained(student).get_vocab())
    renamed = next(piece for piece in pieces if piece.isdigit())
    teacher = _teacher_like(student, str(tmp_path / "teacher"), rename=(renamed, renamed + "x"))
    message = _refusal(student, teacher)
    assert f"the teacher's tokenizer ({teacher!r}, 48 tokens) is not the student's ({student!r}, 48 tokens)" \
        in message, message
    assert repr(renamed) in message  # the differing entries are shown
