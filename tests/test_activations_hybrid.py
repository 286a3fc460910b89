"""The Gated DeltaNet hybrids in the memory plan's counts (megarl/models/memory/activations_hybrid.py):
a linear-attention layer's kept elements, the gated attention's extra, and each rollout
sequence's recurrent state and conv cache, counted by hand for Qwen3-Next-80B-A3B."""

from megarl.models.hf.config import arch_from_hf_config
from megarl.models.memory import activations_hybrid as hybrid
from megarl.models.memory.activations import layer_elements
from megarl.parallel_state.dims import ParallelDims
from tests.published_configs import QWEN3_NEXT_80B_A3B

ARCH = arch_from_hf_config(QWEN3_NEXT_80B_A3B)


def test_recurrent_state_and_conv_cache_per_sequence():
    # 36 linear layers; at tp 4: 8 value heads of a 128 x 128 fp32 state, 3 steps of the conv's
    # (2 * 16 * 128 + 32 * 128) / 4 = 2048 channels in bf16
    assert hybrid.recurrent_state_bytes(ARCH, 4) == 36 * (8 * 128 * 128 * 4 + 3 * 2048 * 2)


def test_linear_layers_count_the_rule_and_full_layers_the_gate():
    dims = ParallelDims(world_size=2, tp=2, ep=2, etp=1)
    h, tp, bf16 = 2048, 2, 2
    qk, v, nv = 16 * 128 / tp, 32 * 128 / tp, 32 / tp
    rule = nv * (2 * 128 + 128 + 2) + nv * 3 * 64 + nv * (128 + 128) + nv * 128 * 128 / 64
    by_hand = h / tp + (2 * qk + 2 * v + 2 * nv) + 2 * (2 * qk + v) + 3 * v + rule * 4 / bf16
    assert hybrid.linear_attention(ARCH, tp, bf16) == by_hand
    linear, full = (layer_elements(ARCH, layer, dims, bf16, flash=True) for layer in (0, 3))
    moe_and_norms = linear - by_hand
    gated = full - moe_and_norms
    assert gated > hybrid.output_gate(ARCH, tp) == 2 * 16 * 256 / tp
