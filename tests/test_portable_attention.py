"""The portable spec's packed (thd) attention: sequences of one length batched into one call give,
bit for bit, what one call per sequence gives (the rows of a batched call are computed as their
own calls compute them), and both equal a plain softmax reference, forward and backward. Bit for
bit on one thread: with two, the CPU's batched matmuls split their sums by the batch's shape (seed
2 then differs in the last bit)."""

import math
import types

import pytest
import torch
from megatron.core.transformer.transformer_config import TransformerConfig

from megarl.models.megatron.portable_layers import PortableCoreAttention

F = torch.nn.functional


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _attention(heads, groups, kv_channels):
    config = TransformerConfig(num_layers=1, hidden_size=heads * kv_channels, num_attention_heads=heads,
                               num_query_groups=groups, kv_channels=kv_channels, attention_dropout=0.0)
    return PortableCoreAttention(config, layer_number=1, attn_mask_type=None, attention_type="self",
                                 pg_collection=types.SimpleNamespace(cp=None))


def _one_call_per_sequence(query, key, value, bounds, heads_per_group, scale):
    outs = []
    for start, end in zip(bounds[:-1], bounds[1:]):
        if end > start:
            q, k, v = (x[start:end].transpose(0, 1)[None] for x in (query, key, value))
            k, v = (x.repeat_interleave(heads_per_group, dim=1) for x in (k, v))
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
            outs.append(out[0].transpose(0, 1))
    out = torch.cat(outs)
    return out.reshape(out.shape[0], -1)


def _softmax_reference(query, key, value, bounds, heads_per_group, scale):
    """Every token against every token in float64, masked to earlier tokens of its own sequence."""
    t = query.shape[0]
    seq = torch.repeat_interleave(torch.arange(len(bounds) - 1), torch.tensor(bounds).diff())
    pos = torch.arange(t)
    allowed = (seq[:, None] == seq[None, :]) & (pos[None, :] <= pos[:, None])
    q, k, v = (x.double().transpose(0, 1) for x in (query, key, value))  # [heads, t, d]
    k, v = (x.repeat_interleave(heads_per_group, dim=0) for x in (k, v))
    scores = (q @ k.transpose(1, 2) * scale).masked_fill(~allowed, -math.inf)
    out = (scores.softmax(-1) @ v).transpose(0, 1)
    return out.reshape(t, -1)


@pytest.mark.parametrize("seed", range(12))
def test_batched_lengths_equal_one_call_per_sequence_and_the_reference(seed):
    g = torch.Generator().manual_seed(seed)
    draw = lambda lo, hi: int(torch.randint(lo, hi, (1,), generator=g))  # noqa: E731
    groups, per_group, d = draw(1, 4), draw(1, 4), 8 * draw(1, 3)
    dv = d if seed % 3 else d + 8  # MLA's value heads are narrower or wider than its query-key heads
    lengths = [draw(0, 5) if seed % 2 else draw(0, 40) for _ in range(draw(1, 60))]  # repeats, and empties
    lengths[0] = max(lengths[0], 1)
    bounds = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    dtype = torch.bfloat16 if seed % 4 == 3 else torch.float32
    attention = _attention(groups * per_group, groups, d)
    scale = attention.softmax_scale
    t = bounds[-1]
    query, key, value = (torch.randn(t, heads, width, generator=g).to(dtype).requires_grad_()
                         for heads, width in ((groups * per_group, d), (groups, d), (groups, dv)))
    grad_out = torch.randn(t, groups * per_group * dv, generator=g).to(dtype)

    packed = types.SimpleNamespace(qkv_format="thd", cu_seqlens_q_padded=torch.tensor(bounds),
                                   cu_seqlens_q=None)
    ours = attention(query, key, value, None, packed_seq_params=packed)
    theirs = _one_call_per_sequence(query, key, value, bounds, per_group, scale)
    ours_grads = torch.autograd.grad(ours, (query, key, value), grad_out)
    their_grads = torch.autograd.grad(theirs, (query, key, value), grad_out)
    assert torch.equal(ours, theirs)
    for a, b in zip(ours_grads, their_grads):
        assert torch.equal(a, b)

    if dtype == torch.float32:
        reference = _softmax_reference(query, key, value, bounds, per_group, scale)
        assert (ours.double() - reference).abs().max() < 1e-5
        reference_grads = torch.autograd.grad(reference, (query, key, value), grad_out.double())
        for a, b in zip(ours_grads, reference_grads):
            assert (a.double() - b).abs().max() < 1e-5
