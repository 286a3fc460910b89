"""The config.json of real models, as published on the Hugging Face Hub, standing in for their
checkpoints (no weights) where a test needs the real architecture: the cluster presets and the
FLOPs formula. Copied field by field; fields megarl ignores (token ids, init range) are left out.
"""

QWEN3_30B_A3B = {  # Qwen/Qwen3-30B-A3B: 30.5B parameters, 3.3B activated
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "attention_bias": False,
    "decoder_sparse_step": 1,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "max_position_embeddings": 40960,
    "mlp_only_layers": [],
    "moe_intermediate_size": 768,
    "norm_topk_prob": True,
    "num_attention_heads": 32,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 48,
    "num_key_value_heads": 4,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000.0,
    "router_aux_loss_coef": 0.001,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "use_sliding_window": False,
    "vocab_size": 151936,
}

MIXTRAL_8X7B = {  # mistralai/Mixtral-8x7B-v0.1 (and -Instruct-v0.1): 46.7B parameters, 12.9B active
    "architectures": ["MixtralForCausalLM"],
    "model_type": "mixtral",
    "hidden_act": "silu",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "max_position_embeddings": 32768,
    "num_attention_heads": 32,
    "num_experts_per_tok": 2,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "num_local_experts": 8,
    "rms_norm_eps": 1e-05,
    "rope_theta": 1000000.0,
    "router_aux_loss_coef": 0.02,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "vocab_size": 32000,
}

# Parameters per token the model cards state (embedding included), for a sanity check.
PUBLISHED_ACTIVE_PARAMS = {"qwen3_30b_a3b": 3.3e9, "mixtral_8x7b": 12.9e9}
