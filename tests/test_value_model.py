"""The critic's value model: the policy trunk with a scalar head. Values at TP2, PP2 and CP2
equal an independent reference: HF transformers' final hidden states times the head. A reward
model (rm:PATH, the same trunk read from an HF *ForSequenceClassification checkpoint) scores as
HF transformers' sequence classification does, at the same layouts."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.launch import finish, start
from tests.workers.value_parity import PAD, rm_rows

# layout -> (world size, ParallelDims fields, model)
LAYOUTS = {"single": (1, {}, "qwen3"), "tp2": (2, {"tp": 2}, "qwen3"), "pp2": (2, {"pp": 2}, "qwen3"),
           "cp2": (2, {"cp": 2}, "qwen3"), "ep2_moe": (2, {"ep": 2}, "qwen3_moe")}


@pytest.fixture(scope="module")
def value_checkpoints(hf_models, tmp_path_factory):
    """Copies of two tiny models with a `score.weight` head, as TRL-style value models carry."""
    import shutil

    out = {}
    for name in ("qwen3", "qwen3_moe"):
        path = tmp_path_factory.mktemp(f"value_{name}")
        shutil.copytree(hf_models[name], path, dirs_exist_ok=True)
        tensors = load_file(str(path / "model.safetensors"))
        hidden = tensors["model.embed_tokens.weight"].shape[1]
        tensors["score.weight"] = torch.randn(1, hidden, generator=torch.Generator().manual_seed(3))
        save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
        out[name] = str(path)
    return out


@pytest.fixture(scope="module")
def reward_models(hf_models, tmp_path_factory):
    """The tiny models saved by HF as one-label sequence classifiers (a seeded random score head)."""
    import transformers

    out = {}
    for name in ("qwen3", "qwen3_moe"):
        path = str(tmp_path_factory.mktemp(f"rm_{name}"))
        torch.manual_seed(5)
        model = transformers.AutoModelForSequenceClassification.from_pretrained(
            hf_models[name], num_labels=1, dtype=torch.float32)
        model.config.pad_token_id = PAD
        model.save_pretrained(path, safe_serialization=True)
        out[name] = path
    return out


@pytest.fixture(scope="module")
def saved(value_checkpoints, reward_models, tmp_path_factory):
    """{layout: what the worker saved}: one launch per world size, which rebuilds the groups for
    each of its layouts (starting a launch takes longer here than computing a layout's values);
    the launches run at once (the one-rank launch would leave a core idle)."""
    root = tmp_path_factory.mktemp("values")
    worlds = {}
    for layout, (world, fields, model) in LAYOUTS.items():
        worlds.setdefault(world, []).append([layout, fields, value_checkpoints[model], reward_models[model]])
    finish(*(start("tests/workers/value_parity.py", "--layouts", json.dumps(layouts), "--out-dir", str(root),
                   nproc=world) for world, layouts in worlds.items()))
    return {layout: torch.load(root / f"{layout}.pt") for layout in LAYOUTS}


def _reference_values(hf_dir, tokens):
    import transformers

    trunk = transformers.AutoModel.from_pretrained(hf_dir, dtype=torch.float32,
                                                   attn_implementation="eager")
    head = load_file(f"{hf_dir}/model.safetensors")["score.weight"]
    with torch.no_grad():
        return (trunk(tokens).last_hidden_state @ head.T).squeeze(-1)  # [B, S]


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_values_match_reference(layout, value_checkpoints, saved):
    from megarl.checks.parity import fixed_tokens

    got = saved[layout]
    tokens = fixed_tokens(250, 4, 32)
    expected = _reference_values(value_checkpoints[LAYOUTS[layout][2]], tokens)
    assert got["values"].shape == expected.shape
    # The critic's column i is the value of the state before token i: the head at position i - 1.
    assert (got["values"][:, 1:] - expected[:, :-1]).abs().max() <= 1e-4
    assert expected.abs().max() > 0.1  # the head is not trivially zero


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_reward_model_scores_as_hf_does(layout, reward_models, saved):
    import transformers


    path = reward_models[LAYOUTS[layout][2]]
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():  # one sequence at a time: HF pools at its last token that is not PAD
        expected = torch.cat([hf(torch.tensor([row])).logits[:, 0] for row in rm_rows(250)])
    got = saved[layout]["rm_scores"]
    assert got.shape == expected.shape
    assert (got - expected).abs().max() <= 1e-4
    assert expected.std() > 0.05  # the scores differ by sequence: the last token is the one read
