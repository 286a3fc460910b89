"""The critic's value model: the policy trunk with a scalar head. Values at TP2, PP2 and CP2
equal an independent reference: HF transformers' final hidden states times the head."""

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.launch import run

LAYOUTS = {"single": (1, []), "tp2": (2, ["--tp", "2"]), "pp2": (2, ["--pp", "2"]),
           "cp2": (2, ["--cp", "2"]), "ep2_moe": (2, ["--ep", "2"])}


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


def _reference_values(hf_dir, tokens):
    import transformers

    trunk = transformers.AutoModel.from_pretrained(hf_dir, dtype=torch.float32,
                                                   attn_implementation="eager")
    head = load_file(f"{hf_dir}/model.safetensors")["score.weight"]
    with torch.no_grad():
        return (trunk(tokens).last_hidden_state @ head.T).squeeze(-1)  # [B, S]


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_values_match_reference(layout, value_checkpoints, tmp_path):
    from megarl.checks.parity import fixed_tokens

    name = "qwen3_moe" if layout == "ep2_moe" else "qwen3"
    nproc, flags = LAYOUTS[layout]
    out = tmp_path / "values.pt"
    run("tests/workers/value_parity.py", "--hf-dir", value_checkpoints[name], "--out", str(out),
        *flags, nproc=nproc)
    got = torch.load(out)
    tokens = fixed_tokens(250, 4, 32)
    expected = _reference_values(value_checkpoints[name], tokens)
    assert got["values"].shape == expected.shape
    # The critic's column i is the value of the state before token i: the head at position i - 1.
    assert (got["values"][:, 1:] - expected[:, :-1]).abs().max() <= 1e-4
    assert expected.abs().max() > 0.1  # the head is not trivially zero
