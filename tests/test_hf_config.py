"""HF config.json parsing: every family, both transformers 4 and 5 field spellings, and errors
that list what is supported."""

import pytest

from megarl.models.hf.config import SUPPORTED_ARCHITECTURES, arch_from_hf_config

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


def test_published_deepseek_v3_and_glm45_air_configs():
    from tests.published_configs import DEEPSEEK_V3, GLM45_AIR

    ds = arch_from_hf_config(DEEPSEEK_V3)
    assert (ds.family, ds.mla, ds.q_lora_rank, ds.kv_lora_rank, ds.qk_rope_dim, ds.head_dim,
            ds.v_head_dim) == ("deepseek_v3", True, 1536, 512, 64, 128, 128)
    assert (ds.moe_score, ds.moe_expert_bias, ds.moe_groups, ds.moe_group_topk, ds.moe_scaling) == \
        ("sigmoid", True, 8, 4, 2.5)
    assert (ds.first_dense_layers, ds.shared_expert_ffn, ds.mtp_layers) == (3, 2048, 1)
    assert (ds.yarn_factor, ds.yarn_original_max_positions, ds.yarn_mscale_all_dim) == (40, 4096, 1.0)
    assert not ds.is_moe_layer(2) and ds.is_moe_layer(3)
    glm = arch_from_hf_config(GLM45_AIR)
    assert (glm.family, glm.rotary_percent, glm.qkv_bias, glm.qk_norm, glm.mla) == \
        ("glm4_moe", 0.5, True, False, False)
    # one group of experts is no group limit at all
    assert (glm.moe_groups, glm.moe_group_topk, glm.first_dense_layers) == (0, 0, 1)


@pytest.mark.parametrize("field,value,message", [
    ("scoring_func", "softmax", r"scoring_func='softmax': megarl supports 'sigmoid'"),
    ("topk_method", "greedy", r"topk_method='greedy': megarl supports 'noaux_tc'"),
    ("norm_topk_prob", False, r"norm_topk_prob=False: megarl supports True"),
    ("topk_group", 3, r"topk_group=3: megarl supports num_experts_per_tok / 2 = 4 when n_group=8"),
    ("n_shared_experts", 0, r"n_shared_experts=0: megarl supports 1 or more"),
    ("first_k_dense_replace", 61, r"first_k_dense_replace=61: megarl supports fewer dense layers"),
    # per-tensor FP8 (block FP8 is read: tests/test_fp8_checkpoints.py)
    ("quantization_config", {"quant_method": "fp8"}, r"no weight_block_size: per-tensor.*dequantize"),
    ("rope_interleave", False, r"rope_interleave=False: megarl supports True"),
    ("rope_scaling", {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
                      "mscale": 0.707}, r"rope_scaling.mscale=0.707: megarl supports 1.0 unless"),
    ("rope_scaling", {"type": "linear", "factor": 2.0}, r"rope_type='linear': megarl supports "
                                                        r"'default' or 'yarn'"),
])
def test_deepseek_fields_megarl_cannot_honour_are_refused_by_name(field, value, message):
    from tests.published_configs import DEEPSEEK_V3

    with pytest.raises(ValueError, match=message):
        arch_from_hf_config({**DEEPSEEK_V3, field: value})


@pytest.mark.parametrize("field,value,message", [
    ("partial_rotary_factor", 0.3, r"partial_rotary_factor=0.3: megarl supports a factor giving an even"),
    ("rope_scaling", {"type": "yarn", "factor": 4.0}, r"rope_type='yarn': megarl supports 'default' RoPE"),
])
def test_glm45_fields_megarl_cannot_honour_are_refused_by_name(field, value, message):
    from tests.published_configs import GLM45_AIR

    with pytest.raises(ValueError, match=message):
        arch_from_hf_config({**GLM45_AIR, field: value})


def test_published_qwen3_next_config():
    from tests.published_configs import QWEN3_NEXT_80B_A3B

    arch = arch_from_hf_config(QWEN3_NEXT_80B_A3B)
    assert arch.family == "qwen3_next" and arch.layer_types.count("full_attention") == 12
    assert [arch.is_linear_layer(i) for i in range(4)] == [True, True, True, False]
    assert (arch.linear_key_heads, arch.linear_value_heads, arch.linear_key_dim, arch.linear_value_dim,
            arch.linear_conv_kernel) == (16, 32, 128, 128, 4)
    assert (arch.attention_output_gate, arch.zero_centered_norm, arch.shared_expert_gate, arch.qk_norm,
            arch.rotary_percent, arch.shared_expert_ffn, arch.mtp_layers) == (True, True, True, True, 0.25,
                                                                              512, 1)
    assert all(arch.is_moe_layer(i) for i in range(arch.num_layers))


@pytest.mark.parametrize("field,value,message", [
    ("layer_types", ["linear_attention", "sliding_attention"] * 24,
     r"layer_types=\['sliding_attention'\]: megarl supports layers of types"),
    ("layer_types", ["full_attention"] * 47, r"layer_types='47 entries': megarl supports one entry"),
    ("linear_num_value_heads", 24, r"linear_num_value_heads=24: megarl supports a multiple of"),
    ("mlp_only_layers", [0], r"mlp_only_layers=\[0\]"),
    ("decoder_sparse_step", 2, r"decoder_sparse_step=2"),
    ("shared_expert_intermediate_size", 0, r"shared_expert_intermediate_size=0"),
    ("attention_bias", True, r"attention_bias=True"),
    ("partial_rotary_factor", 0.3, r"partial_rotary_factor=0.3"),
])
def test_qwen3_next_fields_megarl_cannot_honour_are_refused_by_name(field, value, message):
    from tests.published_configs import QWEN3_NEXT_80B_A3B

    with pytest.raises(ValueError, match=message):
        arch_from_hf_config({**QWEN3_NEXT_80B_A3B, field: value})


def test_linear_attention_layers_refuse_transformer_engine_and_context_parallel():
    from megarl.models.megatron.config_qwen3_next import hybrid_fields
    from megarl.parallel_state.dims import ParallelDims
    from tests.published_configs import QWEN3_NEXT_80B_A3B

    arch = arch_from_hf_config(QWEN3_NEXT_80B_A3B)
    with pytest.raises(ValueError, match=r"layer_types .* model.transformer_engine=false"):
        hybrid_fields(arch, ParallelDims(world_size=1), use_te=True)
    with pytest.raises(ValueError, match=r"context parallel cp=2 .* use cp=1"):
        hybrid_fields(arch, ParallelDims(world_size=2, cp=2), use_te=False)
    with pytest.raises(ValueError, match=r"linear_num_key_heads=16 must be divisible by tp\(32\)"):
        hybrid_fields(arch, ParallelDims(world_size=32, tp=32), use_te=False)
    fields = hybrid_fields(arch, ParallelDims(world_size=1), use_te=False)
    assert fields["linear_attention_freq"][:4] == [1, 1, 1, 0] and fields["attention_output_gate"]


def test_published_qwen35_config_reads_its_text_model():
    from tests.published_configs import QWEN35_397B_A17B

    arch = arch_from_hf_config(QWEN35_397B_A17B)
    assert (arch.family, arch.num_layers, arch.hidden_size, arch.linear_value_heads, arch.num_experts,
            arch.dtype, arch.mtp_layers, arch.rotary_percent) == ("qwen3_5_moe", 60, 4096, 64, 512,
                                                                  "bfloat16", 1, 0.25)
    assert arch.layer_types[:4] == ("linear_attention",) * 3 + ("full_attention",)
    with pytest.raises(ValueError, match="text_config=None"):
        arch_from_hf_config({**QWEN35_397B_A17B, "text_config": None})
