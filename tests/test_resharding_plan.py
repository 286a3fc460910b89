"""The resharding plan is pure: fake metadata in, owners and buckets out, no processes."""

import pytest
import torch

from megarl.models import weight_tables
from megarl.models.hf_config import ModelArch
from megarl.models.param_layout import ParamSlot, local_shard
from megarl.resharding.plan import Piece, build_plan
from megarl.resharding.sync import _engine_slice


def _piece(rank, name, tp_rank=0, tp_size=1, tp_dim=None, shape=(4, 4)):
    return Piece(rank=rank, canonical=name, tp_rank=tp_rank, tp_size=tp_size, tp_dim=tp_dim,
                 glu=False, shape=shape, dtype="torch.float32")


def _tp2_layout():
    """2 TP x 2 DP ranks: a sharded qkv on (0,1) replicated on (2,3); a norm everywhere."""
    pieces = []
    for rank in range(4):
        tp_rank = rank % 2
        pieces.append(_piece(rank, "qkv", tp_rank, 2, 0, (8, 4)))
        pieces.append(_piece(rank, "norm", tp_rank, 2, None, (4,)))
    return tuple(pieces)


def test_owners_are_the_lowest_replica_and_every_shard_is_sent_once():
    plan = build_plan(_tp2_layout(), ("qkv", "norm"), 10**6)
    assert len(plan) == 1
    qkv, norm = plan[0].tensors
    assert [(p.rank, p.tp_rank) for p in qkv.pieces] == [(0, 0), (1, 1)]
    assert [p.rank for p in norm.pieces] == [0]
    assert plan[0].nbytes == (2 * 8 * 4 + 4) * 4


def test_buckets_respect_the_size_and_keep_table_order():
    pieces = tuple(_piece(0, f"t{i}", shape=(10,)) for i in range(5))  # 40 bytes each
    plan = build_plan(pieces, tuple(f"t{i}" for i in range(5)), 100)
    assert [[t.canonical for t in b.tensors] for b in plan] == [["t0", "t1"], ["t2", "t3"], ["t4"]]
    big = build_plan((_piece(0, "big", shape=(100,)), _piece(0, "small", shape=(1,))),
                     ("small", "big"), 16)
    assert [[t.canonical for t in b.tensors] for b in big] == [["small"], ["big"]]


def test_plan_is_cached_per_layout():
    assert build_plan(_tp2_layout(), ("qkv", "norm"), 64) is build_plan(_tp2_layout(), ("qkv", "norm"), 64)


@pytest.mark.parametrize("pieces,expected,message", [
    ((_piece(0, "a"),), ("a", "b"), r"missing \['b'\]"),
    ((_piece(0, "a"), _piece(0, "c")), ("a",), r"unexpected \['c'\]"),
    ((_piece(0, "a", 0, 2, 0),), ("a",), r"a: TP shards \[0\] of 2 are held"),
])
def test_incomplete_or_unexpected_metadata_raises(pieces, expected, message):
    with pytest.raises(ValueError, match=message):
        build_plan(pieces, expected, 100)


# The local path (sync_weights(rollout_tp=...)): tensors every rank already holds for its engine.

def test_same_tp_tensors_are_local_and_not_sent():
    plan = build_plan(_tp2_layout(), ("qkv", "norm"), 10**6, 2)
    assert [t.local for t in plan[0].tensors] == [True, True]
    assert plan[0].owners() == []
    # A rollout TP other than the training TP needs the shards of other ranks.
    plan = build_plan(_tp2_layout(), ("qkv", "norm"), 10**6, 1)
    assert [t.local for t in plan[0].tensors] == [False, True]
    assert plan[0].owners() == [0, 1]
    assert not any(t.local for t in build_plan(_tp2_layout(), ("qkv", "norm"), 10**6)[0].tensors)


def test_a_tensor_missing_on_one_rank_is_sent():
    # PP2: rank 1 lacks stage 0's tensor; a padded vocabulary shard is never the engine's.
    pieces = (_piece(0, "a"), _piece(1, "b"), _piece(0, "n"), _piece(1, "n"),
              _piece(0, "v", 0, 2, 0), _piece(1, "v", 1, 2, 0))
    plan = build_plan(pieces, ("a", "b", "n", "v"), 10**6, 2, frozenset({"v"}))
    assert {t.canonical: t.local for t in plan[0].tensors} == {"a": False, "b": False, "n": True,
                                                             "v": False}


ARCH = ModelArch(family="qwen3", architecture="Qwen3ForCausalLM", vocab_size=512, hidden_size=256,
                 ffn_hidden_size=384, num_layers=1, num_heads=4, num_kv_heads=2, head_dim=64,
                 norm_eps=1e-6, rope_theta=1e4, max_position_embeddings=64, tie_embeddings=False,
                 qkv_bias=False, qk_norm=True, dtype="float32")


def test_engine_slice_is_the_engine_rows_of_the_full_hf_tensor():
    shapes = {"embedding.word_embeddings.weight": ((512, 256), 0, False),
              "decoder.layers.0.self_attention.linear_qkv.weight": ((512, 256), 0, False),
              "decoder.layers.0.self_attention.linear_proj.weight": ((256, 256), 1, False),
              "decoder.layers.0.mlp.linear_fc1.weight": ((768, 256), 0, True),
              "decoder.layers.0.mlp.linear_fc2.weight": ((256, 384), 1, False)}
    for name, (shape, dim, glu) in shapes.items():
        entry = weight_tables.entry_for(ARCH, name)
        full = torch.randn(shape)
        expected = weight_tables.to_hf(ARCH, entry, full)
        for tp_rank in range(2):
            slot = ParamSlot(canonical=name, tp_dim=dim, tp_rank=tp_rank, tp_size=2, glu=glu)
            shard = local_shard(full, slot)
            piece = Piece(rank=tp_rank, canonical=name, tp_rank=tp_rank, tp_size=2, tp_dim=dim,
                          glu=glu, shape=tuple(shard.shape), dtype="torch.float32")
            got, resident = _engine_slice(ARCH, entry, piece, shard)
            assert set(got) == set(expected)
            for hf_name, tensor in expected.items():
                assert got[hf_name].shape == tensor.shape
                rows = tensor.shape[dim] // 2
                assert torch.equal(got[hf_name].narrow(dim, tp_rank * rows, rows),
                                   tensor.narrow(dim, tp_rank * rows, rows)), (name, hf_name)
            assert resident >= shard.numel() * 4
