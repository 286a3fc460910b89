"""The config.json fields of the Gated DeltaNet hybrids (Qwen3-Next; Qwen3.5-MoE's text model, whose
config nests it in text_config beside the vision tower's vision_config):
which layers are linear attention, the linear attention's heads and conv, the gated full
attention, the (1 + w) RMSNorms, partial RoPE, the MoE with a gated shared expert, MTP.

Pure functions from the config dict to ModelArch fields; every value megarl cannot compute the
way HF transformers and vLLM do is refused by name.
"""

from typing import Any, Dict, List

from megarl.models.hf.fields import require, rope_settings, unsupported

LAYER_TYPES = ("linear_attention", "full_attention")


def text_model(cfg: Dict[str, Any]) -> Dict[str, Any]:
    """Qwen3.5-MoE's text model as a flat config: its text_config, with the top level's
    architectures and the fields the top level may hold for the whole model. The vision tower is
    not trained: its tensors are kept aside and given back unchanged (models/weights/mtp.py)."""
    if not isinstance(cfg.get("text_config"), dict):
        raise unsupported("text_config", cfg.get("text_config"), "the text model's config (a dict)")
    flat = dict(cfg["text_config"])
    for field in ("architectures", "tie_word_embeddings", "dtype", "torch_dtype", "quantization_config"):
        if field in cfg:
            flat[field] = cfg[field]
    return flat


def layer_types(cfg: Dict[str, Any], layers: int) -> List[str]:
    """Each layer's token mixer; transformers' default when config.json omits the list: every
    `full_attention_interval`-th layer full attention, the rest linear."""
    types = cfg.get("layer_types")
    if types is None:
        interval = int(cfg.get("full_attention_interval") or 4)
        types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention"
                 for i in range(layers)]
    unknown = sorted({t for t in types} - set(LAYER_TYPES))
    if unknown:
        raise unsupported("layer_types", unknown, f"layers of types {list(LAYER_TYPES)}")
    if len(types) != layers:
        raise unsupported("layer_types", f"{len(types)} entries",
                          f"one entry per layer (num_hidden_layers={layers})")
    return list(types)


def hybrid(cfg: Dict[str, Any], head_dim: int) -> Dict[str, Any]:
    """ModelArch fields of a Gated DeltaNet hybrid (beside the MoE's, which moe() reads)."""
    layers = int(cfg["num_hidden_layers"])
    require(cfg, "attention_bias", (False,), False)
    key_heads, value_heads = int(cfg["linear_num_key_heads"]), int(cfg["linear_num_value_heads"])
    if value_heads % key_heads:
        raise unsupported("linear_num_value_heads", value_heads,
                          f"a multiple of linear_num_key_heads={key_heads}")
    rope = rope_settings(cfg)
    factor = float(rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.25)))
    rotary_dim = head_dim * factor
    if rotary_dim != int(rotary_dim) or int(rotary_dim) % 2 or rotary_dim <= 0:
        raise unsupported("partial_rotary_factor", factor,
                          f"a factor giving an even number of rotated dims of head_dim={head_dim}")
    return dict(
        layer_types=tuple(layer_types(cfg, layers)),
        linear_key_heads=key_heads,
        linear_value_heads=value_heads,
        linear_key_dim=int(cfg["linear_key_head_dim"]),
        linear_value_dim=int(cfg["linear_value_head_dim"]),
        linear_conv_kernel=int(cfg["linear_conv_kernel_dim"]),
        attention_output_gate=True,
        zero_centered_norm=True,
        rotary_percent=factor,
        mtp_layers=int(cfg.get("mtp_num_hidden_layers") or 0),
    )


def moe(cfg: Dict[str, Any]) -> Dict[str, Any]:
    """Softmax top-k routing (renormalized when norm_topk_prob) on every layer, and one shared
    expert whose output a sigmoid gate scales."""
    require(cfg, "decoder_sparse_step", (1,), 1)
    require(cfg, "mlp_only_layers", ([], None))
    shared = int(cfg.get("shared_expert_intermediate_size") or 0)
    if shared < 1:
        raise unsupported("shared_expert_intermediate_size", shared, "a shared expert (>= 1)")
    return dict(moe_ffn_hidden_size=int(cfg["moe_intermediate_size"]),
                moe_norm_topk=bool(cfg.get("norm_topk_prob", True)),
                shared_expert_ffn=shared, shared_expert_gate=True)
