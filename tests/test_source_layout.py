"""source_layout.layout_pieces without processes: Megatron's rank order, the pieces' coverage,
counts and bytes against formulas of their own, the order, refused layouts, a 671B-class layout
in seconds. tests/test_source_layout_live.py compares it with live models over gloo."""

import time
from collections import Counter

import pytest
from megatron.core.parallel_state import RankGenerator

from megarl.models.hf.config import ModelArch
from megarl.models.megatron.config import padded_vocab_size
from megarl.models.weights import tables as weight_tables
from megarl.parallel_state.dims import ParallelDims
from megarl.resharding.source_layout import layout_pieces, rank_coords

FAMILIES = {"qwen3": "Qwen3ForCausalLM", "qwen2": "Qwen2ForCausalLM", "llama": "LlamaForCausalLM",
            "qwen3_moe": "Qwen3MoeForCausalLM", "mixtral": "MixtralForCausalLM"}


def _arch(family="qwen3", **kw) -> ModelArch:
    moe = family in ("qwen3_moe", "mixtral")
    base = dict(family=family, architecture=FAMILIES[family], vocab_size=250, hidden_size=64,
                ffn_hidden_size=96, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=16,
                norm_eps=1e-6, rope_theta=1e4, max_position_embeddings=64, tie_embeddings=False,
                qkv_bias=family == "qwen2", qk_norm=family in ("qwen3", "qwen3_moe"),
                dtype="bfloat16", num_experts=8 if moe else 0, moe_topk=2 if moe else 0,
                moe_ffn_hidden_size=32 if moe else 0)
    return ModelArch(**{**base, **kw})


LAYOUTS = [
    dict(world_size=1),
    dict(world_size=2, tp=2),
    dict(world_size=2, pp=2),
    dict(world_size=4, pp=2, vpp=2),
    dict(world_size=4, tp=2, pp=2),
    dict(world_size=8, tp=2, cp=2, pp=2),
    dict(world_size=4, ep=2),
    dict(world_size=4, tp=2, ep=2, etp=1),
    dict(world_size=8, tp=2, ep=4, etp=1, pp=2),
    dict(world_size=8, ep=2, etp=2, cp=2),
    dict(world_size=16, tp=2, pp=2, vpp=2, ep=2),
]
ARCHS = {"qwen3": _arch("qwen3"), "qwen2": _arch("qwen2"), "llama_tied": _arch("llama", tie_embeddings=True),
         "qwen3_moe": _arch("qwen3_moe"), "mixtral": _arch("mixtral")}


def _cases():
    for fields in LAYOUTS:
        for name, arch in ARCHS.items():
            if fields.get("ep", 1) > 1 and not arch.num_experts:
                continue
            for role in ("policy", "value"):
                yield pytest.param(arch, ParallelDims(**fields), role,
                                   id=f"{name}-{role}-" + "-".join(f"{k}{v}" for k, v in fields.items()))


@pytest.mark.parametrize("fields", LAYOUTS + [dict(world_size=24, tp=2, cp=3, pp=2),
                                              dict(world_size=24, tp=3, pp=2, ep=4, etp=1),
                                              dict(world_size=16, tp=4, ep=2, etp=2, pp=2)])
def test_rank_coordinates_are_megatrons(fields):
    """Every rank's place on every axis is its index in the group Megatron-Core's own
    RankGenerators (its default order, as megarl calls initialize_model_parallel) put it in."""
    dims = ParallelDims(**fields)
    dense = RankGenerator(tp=dims.tp, ep=1, dp=dims.dp, pp=dims.pp, cp=dims.cp, order="tp-cp-ep-dp-pp")
    expert = RankGenerator(tp=dims.expert_tp, ep=dims.ep, dp=dims.expert_dp, pp=dims.pp, cp=1,
                           order="tp-cp-ep-dp-pp")
    coords = [rank_coords(dims, rank) for rank in range(dims.world_size)]
    for generator, axes in ((dense, {"tp": "tp", "cp": "cp", "dp": "dp", "pp": "pp"}),
                            (expert, {"tp": "etp", "ep": "ep", "dp": "edp", "pp": "pp"})):
        for token, field in axes.items():
            for group in generator.get_ranks(token):
                for index, rank in enumerate(group):
                    assert getattr(coords[rank], field) == index, (token, group, rank)


def _full_numel(arch: ModelArch, dims: ParallelDims, role: str) -> int:
    """Parameters of the whole model, written out by hand (Megatron's padded vocabulary)."""
    h, d, vocab = arch.hidden_size, arch.head_dim, padded_vocab_size(arch.vocab_size, dims.tp)
    qkv = (arch.num_heads + 2 * arch.num_kv_heads) * d
    layer = 2 * h + qkv * h + arch.num_heads * d * h
    layer += qkv if arch.qkv_bias else 0
    layer += 2 * d if arch.qk_norm else 0
    if arch.num_experts:
        layer += arch.num_experts * h + arch.num_experts * 3 * arch.moe_ffn_hidden_size * h
    else:
        layer += 3 * arch.ffn_hidden_size * h
    head = h if role == "value" else (0 if arch.tie_embeddings else vocab * h)
    return vocab * h + arch.num_layers * layer + h + head


def _model_numel(pieces) -> int:
    """One copy of each TP shard, and of each replicated tensor."""
    shards = {(p.canonical, p.tp_rank): p.numel for p in pieces if p.tp_dim is not None}
    whole = {p.canonical: p.numel for p in pieces if p.tp_dim is None}
    return sum(shards.values()) + sum(whole.values())


@pytest.mark.parametrize("arch,dims,role", list(_cases()))
def test_every_shard_is_held_by_each_replica_and_sums_to_the_model(arch, dims, role):
    pieces = layout_pieces(arch, dims, role=role)
    expected = [e.megatron for e in weight_tables.entries(arch, role)]
    assert {p.canonical for p in pieces} == set(expected)
    assert len(set(pieces)) == len(pieces)
    # Each TP rank's piece of each tensor (its shard, or its copy of a replicated tensor) is held
    # by every replica: DP x CP ranks, expert-DP ranks for an expert's tensors.
    copies = Counter((p.canonical, p.tp_rank) for p in pieces)
    for canonical in expected:
        is_expert = ".experts." in canonical
        tp_size = dims.expert_tp if is_expert else dims.tp
        replicas = dims.expert_dp if is_expert else dims.dp * dims.cp
        assert [copies[(canonical, t)] for t in range(tp_size)] == [replicas] * tp_size, canonical
    assert sum(copies.values()) == len(pieces)
    assert _model_numel(pieces) == _full_numel(arch, dims, role)
    # Each rank: its stage's layers, its EP rank's experts, the embedding on the first stage,
    # the final norm and output layer on the last.
    per_layer = len([r for r in weight_tables.rows(arch, role) if "{layer}" in r.megatron
                     and "{expert}" not in r.megatron])
    per_expert = len([r for r in weight_tables.rows(arch, role) if "{expert}" in r.megatron])
    layers = arch.num_layers // dims.pp
    experts = arch.num_experts // dims.ep
    tail = 1 + (role == "value" or not arch.tie_embeddings)
    counts = Counter(p.rank for p in pieces)
    for rank in range(dims.world_size):
        pp = rank_coords(dims, rank).pp
        want = layers * (per_layer + experts * per_expert)
        want += (pp == 0) + (tail if pp == dims.pp - 1 else 0)
        assert counts[rank] == want, rank


@pytest.mark.parametrize("arch,dims,role", list(_cases())[::3])
def test_order_is_by_rank_then_weight_table(arch, dims, role):
    pieces = layout_pieces(arch, dims, role=role)
    assert [p.rank for p in pieces] == sorted(p.rank for p in pieces)
    position = {e.megatron: i for i, e in enumerate(weight_tables.entries(arch, role))}
    for rank in range(dims.world_size):
        order = [position[p.canonical] for p in pieces if p.rank == rank]
        assert order == sorted(order)


def test_shapes_and_shards_of_one_layout():
    """TP2 x EP2 x ETP1 on 4 ranks: dense tensors cut over TP, experts whole on their EP rank."""
    arch = _arch("qwen3_moe")
    pieces = layout_pieces(arch, ParallelDims(world_size=4, tp=2, ep=2, etp=1))
    at = {(p.rank, p.canonical): p for p in pieces}
    qkv = at[(1, "decoder.layers.0.self_attention.linear_qkv.weight")]
    assert (qkv.tp_rank, qkv.tp_size, qkv.tp_dim, qkv.shape) == (1, 2, 0, ((4 + 4) * 16 // 2, 64))
    proj = at[(1, "decoder.layers.0.self_attention.linear_proj.weight")]
    assert (proj.tp_dim, proj.shape) == (1, (64, 32))
    embed = at[(3, "embedding.word_embeddings.weight")]
    assert (embed.tp_rank, embed.shape) == (1, (128, 64))  # 250 padded to 256 for TP2
    norm = at[(1, "decoder.layers.3.self_attention.q_layernorm.weight")]
    assert (norm.tp_rank, norm.tp_size, norm.tp_dim, norm.shape) == (1, 2, None, (16,))
    router = at[(0, "decoder.layers.0.mlp.router.weight")]
    assert (router.tp_dim, router.shape) == (None, (8, 64))
    # Expert ranks: etp1 x ep2 x edp2, so rank 1 is EP rank 1 (experts 4-7), whole.
    fc1 = at[(1, "decoder.layers.2.mlp.experts.local_experts.5.linear_fc1.weight")]
    assert (fc1.tp_rank, fc1.tp_size, fc1.tp_dim, fc1.glu, fc1.shape) == (0, 1, None, True, (64, 64))
    assert (1, "decoder.layers.2.mlp.experts.local_experts.3.linear_fc1.weight") not in at
    assert (2, "decoder.layers.2.mlp.experts.local_experts.3.linear_fc1.weight") in at
    assert {p.dtype for p in pieces} == {"torch.bfloat16"}
    assert {p.dtype for p in layout_pieces(arch, ParallelDims(world_size=1), "float32")} == {"torch.float32"}


def test_tied_embeddings_send_the_embedding_only():
    arch = _arch("llama", tie_embeddings=True)
    names = {p.canonical for p in layout_pieces(arch, ParallelDims(world_size=2, pp=2))}
    assert "output_layer.weight" not in names and "embedding.word_embeddings.weight" in names
    value = layout_pieces(arch, ParallelDims(world_size=2, pp=2), role="value")
    head = [p for p in value if p.canonical == "output_layer.weight"]
    assert [(p.rank, p.shape, p.tp_dim) for p in head] == [(1, (1, 64), None)]


@pytest.mark.parametrize("arch,fields,message", [
    (_arch(), dict(world_size=3, pp=3), r"num_layers\(4\) must be divisible by pp\(3\)"),
    (_arch(), dict(world_size=4, pp=2, vpp=4), r"num_layers\(4\) must be divisible by pp\(2\) \* vpp\(4\)"),
    (_arch(), dict(world_size=4, tp=4), r"num_key_value_heads\(2\) must be divisible by tp\(4\)"),
    (_arch(num_heads=3, num_kv_heads=1), dict(world_size=2, tp=2),
     r"num_attention_heads\(3\) must be divisible by tp\(2\)"),
    (_arch(ffn_hidden_size=95), dict(world_size=2, tp=2), r"intermediate_size\(95\) must be divisible"),
    (_arch("qwen3_moe"), dict(world_size=3, ep=3), r"num_experts\(8\) must be divisible by ep\(3\)"),
    (_arch("qwen3_moe", moe_ffn_hidden_size=33), dict(world_size=2, ep=1, etp=2),
     r"moe_intermediate_size\(33\) must be divisible by etp\(2\)"),
    (_arch(), dict(world_size=2, ep=2), r"ep\(2\) > 1 needs an MoE model"),
])
def test_layouts_the_model_cannot_take_are_refused_naming_the_value(arch, fields, message):
    with pytest.raises(ValueError, match=message):
        layout_pieces(arch, ParallelDims(**fields))


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="dtype 'int8'"):
        layout_pieces(_arch(), ParallelDims(world_size=1), "int8")
    with pytest.raises(ValueError, match="role 'critic'"):
        layout_pieces(_arch(), ParallelDims(world_size=1), role="critic")
    with pytest.raises(ValueError, match="rank 4 is outside world size 4"):
        rank_coords(ParallelDims(world_size=4, tp=2), 4)


def test_a_671b_layout_takes_seconds():
    """A DeepSeek-V3-sized Qwen3-MoE (60 layers, 256 experts of 2048, hidden 7168: ~680B
    parameters) on 1024 ranks: metadata only, no tensor is made."""
    arch = _arch("qwen3_moe", vocab_size=129280, hidden_size=7168, num_layers=60, num_heads=128,
                 num_kv_heads=8, head_dim=128, num_experts=256, moe_topk=8, moe_ffn_hidden_size=2048)
    dims = ParallelDims(world_size=1024, tp=8, pp=4, ep=32, etp=1)
    start = time.perf_counter()
    pieces = layout_pieces.__wrapped__(arch, dims)  # not the cached result
    seconds = time.perf_counter() - start
    assert seconds < 30, seconds
    assert _model_numel(pieces) == _full_numel(arch, dims, "policy")
    assert 6.5e11 < _model_numel(pieces) < 7e11
    assert len({p.rank for p in pieces}) == dims.world_size
