"""One checkpoint format for both layer specs: the portable spec's sharded checkpoint keys are
Transformer Engine's (its fused layer-norm names), the set Megatron-Core's own local spec declares
for the same config, and a checkpoint the portable model writes loads, every parameter equal, into
a model built with Megatron-Core's local spec (tests/workers/spec_keys.py, TP2 over gloo)."""

import json

import pytest

from tests.launch import last_json, run

MODELS = ["qwen3", "qwen3_moe", "llama_tied", "mixtral"]


@pytest.fixture(scope="module")
def results(hf_models):
    proc = run("tests/workers/spec_keys.py", "--tp", "2",
               "--models", json.dumps({m: hf_models[m] for m in MODELS}), nproc=2, timeout=600)
    return last_json(proc)["results"]


@pytest.mark.parametrize("model", MODELS)
def test_portable_checkpoints_are_te_keyed_and_load_into_megatrons_local_spec(results, model):
    got = results[model]
    assert got["only_portable"] == [] and got["only_local"] == [], got
    assert got["names_differ"] == [] and got["loaded_equal"], got
    keys = set(got["keys"])
    # TE fuses the attention's input norm into linear_qkv; a dense MLP's norm into linear_fc1,
    # while a MoE layer keeps its pre_mlp_layernorm (the router reads the normed input).
    assert "decoder.layers.self_attention.linear_qkv.layer_norm_weight" in keys
    assert not any(".input_layernorm." in k for k in keys), keys
    moe = model in ("qwen3_moe", "mixtral")
    assert ("decoder.layers.pre_mlp_layernorm.weight" in keys) == moe
    assert ("decoder.layers.mlp.linear_fc1.layer_norm_weight" in keys) == (not moe)
