"""The config.json fields of gpt-oss (GptOssForCausalLM): attention sinks, sliding-window layers
alternating with full ones, biased experts with a clamped SwiGLU, YaRN RoPE, MXFP4 experts.

Pure functions from the config dict to ModelArch fields; every value megarl cannot compute the
way HF transformers and vLLM do is refused by name.
"""

import math
from typing import Any, Dict

from megarl.models.hf.fields import require, rope_settings, unsupported

LAYER_TYPES = {"sliding_attention": True, "full_attention": False}
# Megatron-Core's quick_gelu (and its fused bias kernel) hard-codes this sigmoid gain.
SWIGLU_ALPHA = 1.702
SWIGLU_LIMIT = 7.0


def check_quantization(cfg: Dict[str, Any]) -> None:
    """gpt-oss is published with MXFP4 experts (dequantized on load); any other format is refused."""
    quant = cfg.get("quantization_config")
    if quant:
        require(quant, "quant_method", ("mxfp4",))


def experts(cfg: Dict[str, Any]) -> Dict[str, Any]:
    """Softmax over the top-k router logits (router bias included), biased experts, and the
    clamped SwiGLU: gate clamped above, up clamped both sides, gate * sigmoid(alpha * gate) * (up + 1)."""
    alpha = float(cfg.get("swiglu_alpha", SWIGLU_ALPHA))
    if alpha != SWIGLU_ALPHA:
        raise unsupported("swiglu_alpha", alpha, f"{SWIGLU_ALPHA} (Megatron-Core's quick_gelu gain)")
    limit = float(cfg.get("swiglu_limit", SWIGLU_LIMIT))
    if limit != SWIGLU_LIMIT:
        # vLLM's MoE kernels clamp at 7.0 whatever config.json says (fused_moe/activation.py):
        # measured, a tiny model at 2.0 generated 1.2 nats away from the trainer after a sync.
        raise unsupported("swiglu_limit", limit, f"{SWIGLU_LIMIT} (vLLM's gpt-oss clamp)")
    quant = cfg.get("quantization_config") or {}
    return dict(moe_ffn_hidden_size=int(cfg["intermediate_size"]), moe_norm_topk=True,
                linear_bias=True, swiglu_alpha=alpha, swiglu_limit=limit,
                experts_mxfp4=quant.get("quant_method") == "mxfp4")


def attention(cfg: Dict[str, Any]) -> Dict[str, Any]:
    """Sinks in every layer; sliding-window or full attention per layer_types; YaRN or plain RoPE."""
    layers = int(cfg["num_hidden_layers"])
    require(cfg, "attention_bias", (True,), True)
    # vLLM's gpt-oss builds its norms with eps 1e-5 whatever config.json says, and an LM head of
    # its own (measured: a tied tiny model's sync left vLLM's lm_head.weight unwritten).
    require(cfg, "rms_norm_eps", (1e-5,), 1e-5)
    require(cfg, "tie_word_embeddings", (False,), False)
    kinds = cfg.get("layer_types") or ["sliding_attention" if i % 2 == 0 else "full_attention"
                                       for i in range(layers)]
    unknown = sorted({kind for kind in kinds if kind not in LAYER_TYPES})
    if unknown:
        raise unsupported("layer_types", unknown, " and ".join(repr(k) for k in LAYER_TYPES) +
                          " layers (attention with sinks, sliding or full)")
    if len(kinds) != layers:
        raise unsupported("layer_types", f"{len(kinds)} entries",
                          f"one entry per layer (num_hidden_layers={layers})")
    windows = tuple(LAYER_TYPES[kind] for kind in kinds)
    window = int(cfg.get("sliding_window") or 0)
    if any(windows) and window < 1:
        raise unsupported("sliding_window", cfg.get("sliding_window"),
                          "a positive window when layer_types has sliding_attention layers")
    fields = dict(attention_sinks=True, sliding_window=window if any(windows) else 0,
                  window_layers=windows if any(windows) else ())
    rope = rope_settings(cfg)
    if rope["rope_type"] == "yarn":
        fields.update(_yarn(rope, int(cfg.get("max_position_embeddings", 4096))))
    return fields


def _yarn(rope: Dict[str, Any], max_positions: int) -> Dict[str, Any]:
    """HF's YaRN with its attention factor derived (0.1 ln(factor) + 1 on cos and sin)."""
    for field in ("attention_factor", "mscale", "mscale_all_dim"):
        if rope.get(field) not in (None, 1.0 if field == "mscale" else None):
            raise unsupported(f"rope_scaling.{field}", rope[field],
                              "YaRN's default attention factor 0.1 * ln(factor) + 1 for gpt-oss")
    original = int(rope["original_max_position_embeddings"])
    factor = float(rope.get("factor") or max_positions / original)
    if not (factor > 1 and math.isfinite(factor)):
        raise unsupported("rope_scaling.factor", factor, "a YaRN factor above 1")
    return dict(yarn_factor=factor, yarn_original_max_positions=original,
                yarn_beta_fast=float(rope.get("beta_fast") or 32),
                yarn_beta_slow=float(rope.get("beta_slow") or 1),
                yarn_truncate=bool(rope.get("truncate", True)))
