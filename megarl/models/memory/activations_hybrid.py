"""What a Gated DeltaNet hybrid's own layers keep for their backward (Qwen3-Next, Qwen3.5-MoE):
elements per token of one rank, in the model's dtype unless noted. Pure arithmetic on ModelArch,
beside activations.py's count of the other layers.

A linear-attention layer (megarl's GatedDeltaNet with the portable chunked rule, 64-token chunks;
flash-linear-attention's kernel keeps less, so this bounds it), TP splitting the heads:
  projections   in_proj's input (h/tp) and output ([q|k|v|z|b|a]/tp: the conv's and gates' input),
                the conv's output before and after its SiLU ((2 qk + v)/tp each)
  the rule      q, k (repeated to the value heads), v, g, beta in fp32, the chunk's UT system, decay
                and intra-chunk scores (3 x 64 per head, fp32), u and w (v + k per head, fp32), the
                recurrent state carried into each chunk (Dk x Dv per head, fp32, per 64 tokens)
  gated norm    its input and the gate (v/tp each), out_proj's input (v/tp)
Gated full attention adds the gate's rows (heads x head_dim / tp) and the gated output.
"""

from megarl.models.hf.config import ModelArch

FP32 = 4
CHUNK = 64  # gated_delta_rule.chunk_gated_delta_rule's default


def linear_attention(arch: ModelArch, tp: int, dtype_bytes: int) -> float:
    h, nv = arch.hidden_size, arch.linear_value_heads / tp
    dk, dv = arch.linear_key_dim, arch.linear_value_dim
    qk, v = arch.linear_key_heads * dk / tp, nv * dv
    projections = h / tp + (2 * qk + 2 * v + 2 * nv) + 2 * (2 * qk + v)
    rule = nv * (2 * dk + dv + 2) + nv * 3 * CHUNK + nv * (dv + dk) + nv * dk * dv / CHUNK
    gated_norm = 3 * v
    return projections + gated_norm + rule * FP32 / dtype_bytes


def output_gate(arch: ModelArch, tp: int) -> float:
    """The gated full attention's extra: the gate and the output it scales."""
    return 2 * arch.num_heads * arch.head_dim / tp if arch.attention_output_gate else 0.0


def recurrent_state_bytes(arch: ModelArch, tp: int) -> int:
    """A rollout sequence's state in one engine rank, over all linear-attention layers: the
    recurrent state (fp32, Dk x Dv per value head) and the conv cache (kernel - 1 steps of q, k, v,
    in bf16), what vLLM keeps per sequence in place of a KV cache for these layers."""
    layers = sum(arch.is_linear_layer(i) for i in range(arch.num_layers))
    heads = arch.linear_value_heads // tp
    conv = (2 * arch.linear_key_heads * arch.linear_key_dim + arch.linear_value_heads *
            arch.linear_value_dim) // tp
    return layers * (heads * arch.linear_key_dim * arch.linear_value_dim * FP32
                     + (arch.linear_conv_kernel - 1) * conv * 2)
