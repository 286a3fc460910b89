"""gpt-oss's TransformerConfig fields: biased linears, the clamped SwiGLU, learnable softmax
offsets (sinks), sliding-window layers and YaRN on a GPTModel.

Pure functions of ModelArch; the other families get nothing from them.
"""

from megatron.core.fusions.fused_bias_geglu import quick_gelu

from megarl.models.hf.config import ModelArch


def gpt_oss_fields(arch: ModelArch) -> dict:
    """Fields set over the common ones. Sinks are Megatron's 'learnable' softmax offset; a sliding
    layer sees the `sliding_window` latest tokens, itself included: window_size (W - 1, 0), as
    Transformer Engine and megarl's portable attention read it; window_attn_skip_freq lists the
    sliding layers (1) and full ones (0)."""
    fields = {}
    if arch.linear_bias:
        fields["add_bias_linear"] = True
    if arch.swiglu_alpha:
        # quick_gelu(g) = g * sigmoid(1.702 g) (config_gpt_oss.SWIGLU_ALPHA); (up + 1) and the
        # clamps are Megatron's glu_linear_offset and activation_func_clamp_value.
        fields.update(activation_func=quick_gelu, glu_linear_offset=1.0,
                      activation_func_clamp_value=arch.swiglu_limit or None)
    if arch.attention_sinks:
        fields["softmax_type"] = "learnable"
    if arch.sliding_window:
        fields.update(window_size=(arch.sliding_window - 1, 0),
                      window_attn_skip_freq=[int(w) for w in arch.window_layers])
    return fields


def yarn_attributes(arch: ModelArch) -> dict:
    """GPTModel(position_embedding_type='yarn') reads these from its config as attributes that
    TransformerConfig does not declare (MLA declares its own)."""
    return dict(yarn_rotary_scaling_factor=arch.yarn_factor,
                yarn_original_max_position_embeddings=arch.yarn_original_max_positions,
                yarn_beta_fast=arch.yarn_beta_fast, yarn_beta_slow=arch.yarn_beta_slow,
                yarn_mscale=None, yarn_mscale_all_dim=None,
                yarn_correction_range_round_to_int=arch.yarn_truncate)


def position_embedding_type(arch: ModelArch) -> str:
    return "yarn" if arch.yarn_factor != 1.0 and not arch.mla else "rope"
