"""The portable gated delta rule (megarl/models/megatron/gated_delta_rule.py) against transformers'
torch implementations (Qwen3-Next's torch_chunk_gated_delta_rule, torch_recurrent_gated_delta_rule,
causal_conv1d_fn) in fp32, and against the per-token recurrence written out here in fp64
(transformers computes in fp32 only); packed sequences against each sequence run alone."""

import pytest
import torch
from transformers.models.qwen3_next import modeling_qwen3_next as hf

from megarl.models.megatron import gated_delta_rule as gdr


def _inputs(batch, length, heads, key_dim, value_dim, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(batch, length, heads, key_dim, generator=gen, dtype=dtype) for _ in range(2))
    v = torch.randn(batch, length, heads, value_dim, generator=gen, dtype=dtype)
    # g = -exp(A_log) * softplus(a + dt_bias), as the layer computes it: <= 0, spread over decades
    g = -torch.rand(batch, length, heads, generator=gen, dtype=dtype) * 2.0
    beta = torch.rand(batch, length, heads, generator=gen, dtype=dtype)
    return q, k, v, g, beta


def _recurrence(q, k, v, g, beta):
    """The rule token by token in the inputs' dtype: l2-normalized q, k; q / sqrt(K)."""
    q, k = gdr.l2norm(q), gdr.l2norm(k)
    q = q * q.shape[-1] ** -0.5
    batch, length, heads, key_dim = k.shape
    state = torch.zeros(batch, heads, key_dim, v.shape[-1], dtype=v.dtype)
    outs = []
    for t in range(length):
        state = state * g[:, t].exp()[..., None, None]
        read = (state * k[:, t, ..., None]).sum(-2)  # [B, H, V]
        state = state + k[:, t, ..., None] * ((v[:, t] - read) * beta[:, t, ..., None])[..., None, :]
        outs.append((state * q[:, t, ..., None]).sum(-2))
    return torch.stack(outs, dim=1), state


@pytest.mark.parametrize("length,chunk", [(1, 64), (37, 16), (64, 64), (130, 64)])
def test_chunked_rule_matches_transformers_in_fp32(length, chunk):
    q, k, v, g, beta = _inputs(2, length, 3, 16, 24, torch.float32)
    out, state = gdr.chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=chunk)
    ref, ref_state = hf.torch_chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=chunk,
                                                     output_final_state=True, use_qk_l2norm_in_kernel=True)
    rec, rec_state = hf.torch_recurrent_gated_delta_rule(q, k, v, g, beta, output_final_state=True,
                                                         use_qk_l2norm_in_kernel=True)
    assert out.dtype == torch.float32 and out.shape == (2, length, 3, 24)
    torch.testing.assert_close(out, ref, rtol=0, atol=2e-6)
    torch.testing.assert_close(state, ref_state, rtol=0, atol=2e-6)
    torch.testing.assert_close(out, rec, rtol=0, atol=2e-5)
    torch.testing.assert_close(state, rec_state, rtol=0, atol=2e-5)


def test_chunked_rule_is_the_recurrence_in_fp64_values_and_gradients():
    inputs = [x.requires_grad_() for x in _inputs(2, 45, 2, 8, 12, torch.float64, seed=1)]
    out, state = gdr.chunk_gated_delta_rule(*inputs, chunk_size=16)
    ref, ref_state = _recurrence(*inputs)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
    torch.testing.assert_close(state, ref_state, rtol=0, atol=1e-12)
    weights = torch.randn(out.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    grads = torch.autograd.grad((out * weights).sum(), inputs)
    ref_grads = torch.autograd.grad((ref * weights).sum(), inputs)
    for name, grad, ref_grad in zip("q k v g beta".split(), grads, ref_grads):
        torch.testing.assert_close(grad, ref_grad, rtol=0, atol=1e-11, msg=name)
    # and transformers' fp32 rule agrees with the fp64 one to fp32's precision
    fp32 = hf.torch_recurrent_gated_delta_rule(*(x.detach().float() for x in inputs),
                                               use_qk_l2norm_in_kernel=True)[0]
    torch.testing.assert_close(fp32.double(), ref.detach(), rtol=0, atol=2e-6)


def test_bf16_inputs_compute_in_fp32_as_transformers_does():
    q, k, v, g, beta = _inputs(1, 50, 2, 16, 16, torch.float32, seed=3)
    q, k, v = (x.bfloat16() for x in (q, k, v))
    out, _ = gdr.chunk_gated_delta_rule(q, k, v, g, beta)
    ref, _ = hf.torch_chunk_gated_delta_rule(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref.float(), rtol=0, atol=1e-2)


def test_causal_conv_matches_transformers():
    gen = torch.Generator().manual_seed(4)
    x, weight = torch.randn(2, 19, 10, generator=gen), torch.randn(10, 4, generator=gen)
    ref = hf.causal_conv1d_fn(x.transpose(1, 2), weight, None, activation="silu").transpose(1, 2)
    torch.testing.assert_close(gdr.causal_conv1d(x, weight), ref, rtol=0, atol=1e-6)


def test_a_pack_resets_the_state_and_the_conv_at_every_boundary():
    """Sequences of different lengths (some alike, one past a chunk) packed, with padding after
    the last: each sequence's output equals it run alone; the padding's is zero."""
    lengths = [5, 70, 5, 1, 33]
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    total = cu[-1] + 3  # padding past the last sequence
    q, k, v, g, beta = (x[0] for x in _inputs(1, total, 2, 8, 8, torch.float64, seed=5))
    out = gdr.packed_gated_delta_rule(q, k, v, g, beta, cu, chunk_size=16)
    weight = torch.randn(48, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(6))
    mixed = torch.cat([q.reshape(total, -1), k.reshape(total, -1), v.reshape(total, -1)], -1)
    conv = gdr.packed_causal_conv1d(mixed, weight, cu)
    assert out.shape == (total, 16) and conv.shape == (total, 48)
    for start, end in zip(cu[:-1], cu[1:]):
        alone, _ = gdr.chunk_gated_delta_rule(*(x[None, start:end] for x in (q, k, v, g, beta)),
                                              chunk_size=16)
        torch.testing.assert_close(out[start:end], alone[0].reshape(end - start, -1), rtol=0, atol=1e-13)
        torch.testing.assert_close(conv[start:end], gdr.causal_conv1d(mixed[None, start:end], weight)[0],
                                   rtol=0, atol=0)
    assert not out[cu[-1]:].any() and not conv[cu[-1]:].any()


def test_the_kernel_is_chosen_by_availability():
    assert gdr.rule_kernel(torch.device("cpu")) == "torch"
    assert gdr.rule_kernel(torch.device("cuda")) == ("fla" if gdr.fla_available() else "torch")
