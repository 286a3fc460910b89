"""HF config.json parsing: every family, both transformers 4 and 5 field spellings, and errors
that list what is supported."""

import pytest

from megarl.models.hf_config import SUPPORTED_ARCHITECTURES, arch_from_hf_config

BASE = dict(vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16)


def test_qwen3_moe_old_and_new_field_names_agree():
    old = arch_from_hf_config(dict(BASE, architectures=["Qwen3MoeForCausalLM"], num_experts=8,
                                   num_experts_per_tok=2, moe_intermediate_size=32,
                                   rope_theta=1e6, norm_topk_prob=True))
    new = arch_from_hf_config(dict(BASE, architectures=["Qwen3MoeForCausalLM"],
                                   num_local_experts=8, num_experts_per_tok=2,
                                   moe_intermediate_size=32, norm_topk_prob=True,
                                   rope_parameters={"rope_type": "default", "rope_theta": 1e6}))
    assert old == new
    assert (old.num_experts, old.moe_topk, old.rope_theta, old.qk_norm) == (8, 2, 1e6, True)


def test_family_specific_fields():
    qwen2 = arch_from_hf_config(dict(BASE, architectures=["Qwen2ForCausalLM"]))
    llama = arch_from_hf_config(dict(BASE, architectures=["LlamaForCausalLM"],
                                     tie_word_embeddings=True))
    mixtral = arch_from_hf_config(dict(BASE, architectures=["MixtralForCausalLM"],
                                       num_local_experts=8, num_experts_per_tok=2))
    assert qwen2.qkv_bias and not qwen2.qk_norm
    assert llama.tie_embeddings and not llama.qkv_bias
    assert mixtral.moe_ffn_hidden_size == 128 and mixtral.moe_norm_topk


def test_unsupported_architecture_lists_supported():
    with pytest.raises(ValueError) as err:
        arch_from_hf_config(dict(BASE, architectures=["GPT2LMHeadModel"]))
    for name in SUPPORTED_ARCHITECTURES:
        assert name in str(err.value)


@pytest.mark.parametrize("field,value,allowed", [
    ("hidden_act", "gelu", "'silu'"),
    ("rope_scaling", {"rope_type": "yarn", "factor": 4.0}, "'default'"),
    ("use_sliding_window", True, "False"),
    ("mlp_bias", True, "False"),
    ("dtype", "float8", "bfloat16"),
])
def test_unsupported_fields_name_the_field_and_the_choices(field, value, allowed):
    with pytest.raises(ValueError, match="unsupported config field") as err:
        arch_from_hf_config(dict(BASE, architectures=["Qwen3ForCausalLM"], **{field: value}))
    assert allowed in str(err.value)


def test_renormalized_top1_routing_is_refused():
    """Found by tests/test_conversion_fuzz.py: Megatron-Core cannot express it (see hf_config)."""
    mixtral = dict(BASE, architectures=["MixtralForCausalLM"], num_local_experts=4, num_experts_per_tok=1)
    with pytest.raises(ValueError, match=r"num_experts_per_tok=1: megarl supports top-k >= 2 when"):
        arch_from_hf_config(mixtral)
    qwen = dict(BASE, architectures=["Qwen3MoeForCausalLM"], num_experts=4, num_experts_per_tok=1,
                moe_intermediate_size=64)
    assert arch_from_hf_config(dict(qwen, norm_topk_prob=False)).moe_topk == 1
    with pytest.raises(ValueError, match="num_experts_per_tok=1"):
        arch_from_hf_config(dict(qwen, norm_topk_prob=True))


def test_qwen2_head_dim_must_follow_hidden_size():
    with pytest.raises(ValueError, match="head_dim=32"):
        arch_from_hf_config(dict(BASE, architectures=["Qwen2ForCausalLM"], head_dim=32))
