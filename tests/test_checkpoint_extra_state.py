"""A Megatron checkpoint written from either layer spec loads into a model built with the other:
Transformer Engine's `_extra_state` (fp8 metadata) is tolerated where one side lacks it, while
any other key on one side only is refused by name (megarl.models.weights.checkpoint.load)."""

import random

import pytest

from megarl.models.weights.checkpoint import drop_absent_extra_state
from tests.launch import last_json, run

WEIGHTS = ["embedding.word_embeddings.weight", "decoder.final_layernorm.weight", "output_layer.weight",
           "decoder.layers.self_attention.linear_qkv.weight", "decoder.layers.mlp.linear_fc1.weight",
           "decoder.layers.mlp.experts.experts.linear_fc1.weight",
           # Look like fp8 metadata, are not: only a module's own `_extra_state` is TE's.
           "decoder.layers.mlp.linear_fc1.my_extra_state", "decoder.layers._extra_state_scale"]
EXTRA_STATES = ["decoder.layers.self_attention.linear_qkv._extra_state",
                "decoder.layers.self_attention.core_attention._extra_state",
                "decoder.layers.self_attention.q_layernorm._extra_state",
                "decoder.layers.mlp.experts.experts.linear_fc1._extra_state", "_extra_state"]


def test_only_extra_state_may_be_on_one_side_fuzzed():
    rng = random.Random(0)
    for _ in range(2000):
        requested = {k for k in WEIGHTS + EXTRA_STATES if rng.random() < 0.6}
        stored = {k for k in WEIGHTS + EXTRA_STATES if rng.random() < 0.6}
        if rng.random() < 0.5:  # half the draws: the same weights on both sides
            stored = (stored & set(EXTRA_STATES)) | (requested & set(WEIGHTS))
        lacking = sorted((requested - stored) & set(WEIGHTS))
        unused = sorted((stored - requested) & set(WEIGHTS))
        if lacking or unused:
            with pytest.raises(ValueError) as error:
                drop_absent_extra_state(requested, stored, "ckpt")
            message = str(error.value)
            assert message.startswith("Megatron checkpoint 'ckpt' does not fit this model"), message
            assert all(repr(k) in message for k in lacking + unused), (message, lacking, unused)
            assert ("it lacks" in message) == bool(lacking) and ("it holds" in message) == bool(unused)
            assert not any(repr(k) in message for k in EXTRA_STATES), message
        else:
            loadable = drop_absent_extra_state(requested, stored, "ckpt")
            assert loadable == requested & stored  # requested fp8 metadata the checkpoint lacks: left out
            assert requested & set(WEIGHTS) <= loadable


def test_a_long_mismatch_is_named_in_part():
    weights = [f"decoder.layers.w{i:02d}.weight" for i in range(20)]
    with pytest.raises(ValueError, match=r"it lacks the model's \['decoder.layers.w00.weight', .*"
                                         r"'decoder.layers.w07.weight'\] and 12 more; load a checkpoint"):
        drop_absent_extra_state(weights, [], "ckpt")


@pytest.fixture(scope="module")
def ranks(hf_models, tmp_path_factory):
    # Two pipeline stages: a key only one stage asks for still counts, and every rank refuses alike.
    proc = run("tests/workers/extra_state.py", "--hf-dir", hf_models["qwen3"], "--out-dir",
               str(tmp_path_factory.mktemp("extra_state")), "--pp", "2", nproc=2, timeout=300)
    got = last_json(proc)
    assert got["world"] == 2
    return got["ranks"]


def test_checkpoints_of_either_spec_load_into_the_other(ranks):
    for got in ranks:
        # What the round trips stand on: TE's model asks for fp8 metadata the portable one never writes.
        assert got["te_only_keys"] == ["decoder.layers.self_attention.core_attention._extra_state",
                                       "decoder.layers.self_attention.k_layernorm._extra_state",
                                       "decoder.layers.self_attention.q_layernorm._extra_state"], got
        assert got["portable_only_keys"] == [], got
        assert got["portable_into_te"] == {"weights_equal": True, "metas_fresh": True}, got
        assert got["te_into_portable"] == {"weights_equal": True}, got
        # Fp8 metadata the checkpoint has still loads.
        assert got["te_into_te"]["weights_equal"] and got["te_into_te"]["metas_loaded"], got
        assert got["te_into_te"]["metas"] > 0, got


def test_any_other_missing_or_unexpected_key_is_refused_by_name(ranks):
    for got in ranks:
        assert "it lacks the model's ['decoder.final_layernorm.weight']" in got["lacking_error"], got
        assert "it holds ['decoder.unknown.weight'], which the model does not have" in got["extra_error"], got
