"""Split/merge functions against loop references, and local shard <-> full tensor inverses."""

import pytest
import torch

from megarl.models.megatron.param_layout import ParamSlot, join_shards, local_shard
from megarl.models.weights import transforms as wt


@pytest.mark.parametrize("heads,kv_heads", [(4, 1), (4, 2), (4, 4), (8, 2)])
def test_merge_qkv_matches_loop_reference(heads, kv_heads):
    d, h = 3, 5
    q, k, v = torch.randn(heads * d, h), torch.randn(kv_heads * d, h), torch.randn(kv_heads * d, h)
    rows = []
    per_group = heads // kv_heads
    for g in range(kv_heads):  # Megatron: each KV group's queries, then its key, then its value
        for i in range(per_group):
            rows.append(q[(g * per_group + i) * d:(g * per_group + i + 1) * d])
        rows.append(k[g * d:(g + 1) * d])
        rows.append(v[g * d:(g + 1) * d])
    merged = wt.merge_qkv(q, k, v, heads, kv_heads, d)
    assert torch.equal(merged, torch.cat(rows))
    assert all(torch.equal(a, b) for a, b in zip(wt.split_qkv(merged, heads, kv_heads, d), (q, k, v)))
    bias = [t[:, 0].contiguous() for t in (q, k, v)]
    assert torch.equal(wt.merge_qkv(*bias, heads, kv_heads, d), merged[:, 0])


def test_gate_up_and_vocab_padding_round_trip():
    gate, up = torch.randn(6, 4), torch.randn(6, 4)
    assert all(torch.equal(a, b) for a, b in zip(wt.split_gate_up(wt.merge_gate_up(gate, up)),
                                                 (gate, up)))
    emb = torch.randn(250, 4)
    padded = wt.pad_vocab(emb, 256)
    assert padded.shape == (256, 4) and torch.equal(padded[250:], torch.zeros(6, 4))
    assert torch.equal(wt.unpad_vocab(padded, 250), emb)
    with pytest.raises(ValueError, match="smaller than vocab"):
        wt.pad_vocab(emb, 128)


def _slot(tp_dim, tp_rank, tp_size, glu=False):
    return ParamSlot(canonical="w", tp_dim=tp_dim, tp_rank=tp_rank, tp_size=tp_size, glu=glu)


@pytest.mark.parametrize("tp_dim,glu", [(0, False), (1, False), (0, True), (None, False)])
def test_local_shards_join_back_to_the_full_tensor(tp_dim, glu):
    full = torch.randn(8, 6)
    shards = [local_shard(full, _slot(tp_dim, r, 2, glu)) for r in range(2)]
    assert torch.equal(join_shards(shards, tp_dim, glu), full)


def test_glu_shard_holds_matching_gate_and_up_rows():
    gate, up = torch.arange(8.).reshape(4, 2), 100 + torch.arange(8.).reshape(4, 2)
    shard = local_shard(torch.cat([gate, up]), _slot(0, 1, 2, glu=True))
    assert torch.equal(shard, torch.cat([gate[2:], up[2:]]))
