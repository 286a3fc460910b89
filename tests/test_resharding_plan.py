"""The resharding plan is pure: fake metadata in, owners and buckets out, no processes."""

import pytest

from megarl.resharding.plan import Piece, build_plan


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
