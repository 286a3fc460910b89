"""Tiny random HF checkpoints of every supported family, made locally (nothing is downloaded).

Used by the tests, the demo and the benchmarks. head_dim is 64 because vLLM's CPU attention
rejects smaller heads, and hidden = heads * head_dim because vLLM's Qwen2 ignores `head_dim`.
Weights are drawn with a fixed seed and a larger std than HF's default so
that layouts which mix up rows produce visibly different log-probs.
"""

from typing import Any, Dict

import torch

BASE = dict(vocab_size=250, hidden_size=256, intermediate_size=256, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=256,
            rms_norm_eps=1e-6, tie_word_embeddings=False)
# Variants that break naive conversion code, named for the tests and benchmarks.
VARIANTS: Dict[str, Dict[str, Any]] = {
    "llama_tied": dict(family="llama", tie_word_embeddings=True),
    "qwen2_gqa1": dict(family="qwen2", num_key_value_heads=1),
}
FAMILIES: Dict[str, Dict[str, Any]] = {
    "llama": dict(architectures=["LlamaForCausalLM"], model_type="llama"),
    "qwen2": dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2"),
    "qwen3": dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3"),
    "qwen3_moe": dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe",
                      num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64,
                      norm_topk_prob=False, router_aux_loss_coef=0.0),
    "mixtral": dict(architectures=["MixtralForCausalLM"], model_type="mixtral",
                    num_local_experts=8, num_experts_per_tok=2, intermediate_size=64,
                    router_aux_loss_coef=0.0),
}


def make_tiny_checkpoint(family: str, out_dir: str, seed: int = 0, std: float = 0.08,
                         **overrides) -> str:
    """Write config.json + model.safetensors of a random `family` model; return out_dir."""
    import transformers

    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; choose from {sorted(FAMILIES)}")
    fields = {**BASE, **FAMILIES[family], **overrides}
    config_cls = transformers.CONFIG_MAPPING[fields["model_type"]]
    kwargs = {k: v for k, v in fields.items() if k not in ("architectures", "model_type")}
    if family == "qwen3_moe":
        kwargs["num_local_experts"] = kwargs.pop("num_experts")  # transformers 5 name
    config = config_cls(**kwargs, architectures=fields["architectures"])
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                param.copy_(1.0 + 0.1 * torch.randn_like(param))
            else:
                param.normal_(0.0, std)
    model.save_pretrained(out_dir, safe_serialization=True)
    return out_dir


def make_named(name: str, out_dir: str, seed: int = 0) -> str:
    """A family name or a VARIANTS name."""
    if name in VARIANTS:
        overrides = dict(VARIANTS[name])
        return make_tiny_checkpoint(overrides.pop("family"), out_dir, seed=seed, **overrides)
    return make_tiny_checkpoint(name, out_dir, seed=seed)
