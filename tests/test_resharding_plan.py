"""The resharding plan is pure: source pieces and destination layouts in, copies out, no processes.

Fuzzed like the converters: random small architectures x training layouts x rollout TP/EP. The
plan is executed in one process (every rank's pieces cut from one random full model) and each
rank's engine tensors are compared with an independent reference built from the HF tensors the
way vLLM's own loaders shard them. The real engine is checked by tests/test_weight_sync*.py.
"""

import random

import pytest
import torch

from megarl.models.hf.config import ModelArch
from megarl.models.megatron.param_layout import ParamSlot, local_shard
from megarl.models.weights import tables as weight_tables
from megarl.models.weights.destination import VLLM_VOCAB_PADDING, RolloutLayout, hf_tensors, vllm_layout
from megarl.parallel_state.dims import ParallelDims
from megarl.resharding import metadata, sync
from megarl.resharding.plan import Piece, build_plan
from megarl.resharding.source_layout import layout_pieces
from megarl.rollout.engine import WeightLayout

FAMILIES = {"qwen3": "Qwen3ForCausalLM", "qwen2": "Qwen2ForCausalLM", "llama": "LlamaForCausalLM",
            "qwen3_moe": "Qwen3MoeForCausalLM", "mixtral": "MixtralForCausalLM"}


def random_arch(rng: random.Random) -> ModelArch:
    family = rng.choice(sorted(FAMILIES))
    kv = rng.choice([1, 2, 4])
    heads = kv * rng.choice([1, 2, 3])
    head_dim = rng.choice([8, 16])
    moe = family in ("qwen3_moe", "mixtral")
    return ModelArch(family=family, architecture=FAMILIES[family],
                     vocab_size=rng.choice([61, 128, 200, 257]), hidden_size=rng.choice([32, 48]),
                     ffn_hidden_size=rng.choice([24, 48, 96]), num_layers=rng.choice([2, 4]),
                     num_heads=heads, num_kv_heads=kv, head_dim=head_dim, norm_eps=1e-6,
                     rope_theta=1e4, max_position_embeddings=64,
                     tie_embeddings=family == "llama" and rng.random() < 0.5,
                     qkv_bias=family == "qwen2", qk_norm=family in ("qwen3", "qwen3_moe"),
                     dtype="float32", num_experts=rng.choice([4, 8]) if moe else 0,
                     moe_topk=2 if moe else 0, moe_ffn_hidden_size=rng.choice([16, 24, 48]) if moe else 0)


def random_dims(rng: random.Random, arch: ModelArch) -> ParallelDims:
    while True:
        world = rng.choice([1, 2, 4])
        tp = rng.choice([d for d in (1, 2, 4) if world % d == 0 and arch.num_kv_heads % d == 0
                         and arch.ffn_hidden_size % d == 0])
        pp = rng.choice([d for d in (1, 2) if world % (tp * d) == 0 and arch.num_layers % d == 0])
        ep = etp = 1
        if arch.num_experts:
            ep = rng.choice([d for d in (1, 2, 4) if world % (d * pp) == 0 and arch.num_experts % d == 0])
            etp = rng.choice([d for d in (1, tp) if world % (d * ep * pp) == 0
                              and arch.moe_ffn_hidden_size % d == 0])
        try:
            return ParallelDims(world_size=world, tp=tp, pp=pp, ep=ep, etp=etp)
        except ValueError:
            continue


def random_rollout(rng: random.Random, arch: ModelArch, world: int) -> RolloutLayout:
    tps = [d for d in (1, 2, 4) if world % d == 0 and arch.num_heads % d == 0
           and (arch.num_kv_heads % d == 0 or d % arch.num_kv_heads == 0)
           and arch.ffn_hidden_size % d == 0 and arch.moe_ffn_hidden_size % d == 0]
    tp = rng.choice(tps)
    eps = [1] + ([tp] if arch.num_experts and tp > 1 and arch.num_experts % tp == 0 else [])
    return RolloutLayout(tp, rng.choice(eps))


def cut_model(arch: ModelArch, pieces, seed: int):
    """One random full Megatron model (padding rows zero) and every rank's pieces cut from it."""
    gen = torch.Generator().manual_seed(seed)
    full = {}
    for p in pieces:
        if p.canonical not in full:
            shape = list(p.shape)
            if p.tp_dim is not None:
                shape[p.tp_dim] *= p.tp_size
            full[p.canonical] = torch.randn(shape, generator=gen)
            if p.canonical.endswith(("word_embeddings.weight", "output_layer.weight")):
                full[p.canonical][arch.vocab_size:] = 0
    held = {}
    for p in pieces:
        slot = ParamSlot(p.canonical, p.tp_dim, p.tp_rank, p.tp_size, p.glu)
        held.setdefault(p.rank, {})[(p.canonical, p.tp_rank)] = local_shard(full[p.canonical], slot)
    return full, held


def execute(plan, held):
    """Every copy of the plan, on tensors filled with NaN: what stays NaN was never written."""
    out = {rank: {t.name: torch.full(t.shape, float("nan")) for t in tensors}
           for rank, tensors in plan.tensors.items()}
    writes = {rank: {t.name: torch.zeros(t.shape) for t in tensors} for rank, tensors in plan.tensors.items()}
    for bucket in plan.buckets:
        for c in bucket.copies:
            source = held[c.src][(c.canonical, c.tp_rank)].narrow(c.dim, c.src_start, c.length)
            for target in (out[c.dst][c.tensor], writes[c.dst][c.tensor]):
                view = target[c.expert] if c.expert is not None else target
                view = view.narrow(c.dim, c.dst_start, c.length)
                view.copy_(source) if target is out[c.dst][c.tensor] else view.add_(1)
    return out, writes


def hf_of(arch: ModelArch, full):
    hf = {}
    for entry in weight_tables.entries(arch):
        hf.update(weight_tables.to_hf(arch, entry, full[entry.megatron][:arch.vocab_size]
                                      if entry.transform == "vocab" else full[entry.megatron]))
    return hf


def _kv_heads(x, kv: int, tp: int, t: int):
    """Engine rank t's KV heads: its share, or the one head it replicates when tp > kv."""
    return x.chunk(tp)[t] if kv >= tp else x.chunk(kv)[t // (tp // kv)]


def vllm_reference(arch: ModelArch, hf, rollout: RolloutLayout, t: int):
    """What vLLM's loaders make of the HF tensors on engine rank t, written from HF names."""
    tp, kv = rollout.tp, arch.num_kv_heads
    ref = {}
    for name, w in hf.items():
        if ".k_proj." in name or ".v_proj." in name or ".up_proj." in name or ".w3." in name:
            continue
        if ".q_proj." in name:  # weight and bias
            k, v = hf[name.replace("q_proj", "k_proj")], hf[name.replace("q_proj", "v_proj")]
            ref[name.replace("q_proj", "qkv_proj")] = torch.cat(
                [w.chunk(tp)[t], _kv_heads(k, kv, tp, t), _kv_heads(v, kv, tp, t)])
        elif ".experts." in name:
            layer = name.split(".experts.")[0] + ".experts.routed_experts"
            e = int(name.split(".experts.")[1].split(".")[0])
            per = arch.num_experts // rollout.ep
            if e // per != (t if rollout.ep > 1 else 0):
                continue
            width_tp = 1 if rollout.ep > 1 else tp
            u = t % width_tp
            if ".gate_proj." in name or ".w1." in name:
                up = hf[name.replace("gate_proj", "up_proj").replace(".w1.", ".w3.")]
                key, value = layer + ".w13_weight", torch.cat([w.chunk(width_tp)[u], up.chunk(width_tp)[u]])
            else:
                key, value = layer + ".w2_weight", w.chunk(width_tp, dim=1)[u]
            ref.setdefault(key, [None] * per)[e % per] = value
        elif ".gate_proj." in name:
            up = hf[name.replace("gate_proj", "up_proj")]
            ref[name.replace("gate_proj", "gate_up_proj")] = torch.cat([w.chunk(tp)[t], up.chunk(tp)[t]])
        elif name.endswith(("o_proj.weight", "down_proj.weight")):
            ref[name] = w.chunk(tp, dim=1)[t]
        elif name in ("model.embed_tokens.weight", "lm_head.weight"):
            padded = -(-arch.vocab_size // VLLM_VOCAB_PADDING) * VLLM_VOCAB_PADDING
            ref[name] = torch.cat([w, w.new_zeros(padded - w.shape[0], w.shape[1])]).chunk(tp)[t]
        else:
            ref[name] = w
    return {k: torch.stack(v) if isinstance(v, list) else v for k, v in ref.items()}


def _padding_zero(out):
    return {name: t.nan_to_num(0.0) if name.endswith(("embed_tokens.weight", "lm_head.weight")) else t
            for name, t in out.items()}


@pytest.mark.parametrize("seed", range(40))
def test_fuzz_every_engine_tensor_is_written_once_and_equals_vllms_sharding(seed):
    rng = random.Random(seed)
    arch = random_arch(rng)
    dims = random_dims(rng, arch)
    rollout = random_rollout(rng, arch, dims.world_size)
    pieces = layout_pieces(arch, dims, "torch.float32")
    layout = vllm_layout(arch, rollout, dims.world_size)
    plan = build_plan(pieces, tuple(sorted(layout.items())), rng.choice([1, 4096, 10**9]))
    full, held = cut_model(arch, pieces, seed)
    out, writes = execute(plan, held)
    hf = hf_of(arch, full)
    context = (arch, dims, rollout)
    for rank in range(dims.world_size):
        ref = vllm_reference(arch, hf, rollout, rank % rollout.tp)
        got = _padding_zero(out[rank])
        assert set(got) == set(ref), context
        for name in ref:
            assert got[name].shape == ref[name].shape, (name, context)
            assert torch.equal(got[name], ref[name]), (name, context)
            assert writes[rank][name].max() <= 1, (name, "written twice", context)
        # Each rank receives only its own engine shard (and not more than once).
        assert plan.received(rank) <= plan.shard_bytes(rank), context


@pytest.mark.parametrize("seed", range(10))
def test_fuzz_hf_layout_is_the_checkpoint_bit_exact(seed):
    rng = random.Random(1000 + seed)
    arch = random_arch(rng)
    dims = random_dims(rng, arch)
    pieces = layout_pieces(arch, dims, "torch.float32")
    plan = build_plan(pieces, ((0, hf_tensors(arch)),), rng.choice([1, 10**9]))
    full, held = cut_model(arch, pieces, seed)
    out, _ = execute(plan, held)
    hf = hf_of(arch, full)
    assert set(out[0]) == set(hf)
    for name, tensor in hf.items():
        assert torch.equal(out[0][name], tensor), name


def _arch(**kw):
    base = dict(family="qwen3", architecture="Qwen3ForCausalLM", vocab_size=256, hidden_size=32,
                ffn_hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                norm_eps=1e-6, rope_theta=1e4, max_position_embeddings=64, tie_embeddings=False,
                qkv_bias=False, qk_norm=False, dtype="float32")
    return ModelArch(**{**base, **kw})


def test_same_tp_moves_nothing_and_each_rank_receives_only_its_shard():
    arch = _arch()
    same = build_plan(layout_pieces(arch, ParallelDims(world_size=4, tp=2)),
                      tuple(sorted(vllm_layout(arch, RolloutLayout(2), 4).items())), 10**9)
    assert all(same.received(r) == 0 for r in range(4))
    # TP2 x PP2 into rollout TP1: each rank receives the half of the model its stage lacks,
    # never the whole model (the old broadcast sent (W-1) x model bytes to every rank).
    pp = build_plan(layout_pieces(arch, ParallelDims(world_size=4, tp=2, pp=2)),
                    tuple(sorted(vllm_layout(arch, RolloutLayout(1), 4).items())), 10**9)
    for rank in range(4):
        assert 0 < pp.received(rank) < pp.shard_bytes(rank)


def test_replicas_on_the_receivers_node_are_preferred():
    arch = _arch()
    pieces = layout_pieces(arch, ParallelDims(world_size=4, tp=2))  # DP replicas: ranks 0,1 / 2,3
    layout = tuple(sorted(vllm_layout(arch, RolloutLayout(1), 4).items()))
    plan = build_plan(pieces, layout, 10**9, (0, 0, 1, 1))
    for c in plan.buckets[0].copies:
        assert c.src // 2 == c.dst // 2, c


def test_buckets_hold_whole_modules_and_rounds_fit_the_bucket():
    arch = _arch(num_layers=4)
    pieces = layout_pieces(arch, ParallelDims(world_size=2, pp=2))
    layout = tuple(sorted(vllm_layout(arch, RolloutLayout(1), 2).items()))
    small = build_plan(pieces, layout, 4096, None, RolloutLayout(1).engines(2))
    for rank, tensors in layout:  # every module of a rank's engine once, in one bucket
        modules = [m for b in small.buckets for m in b.modules.get(rank, ())]
        assert sorted(modules) == sorted({t.module for t in tensors}) and len(small.buckets) > 4
    for bucket in small.buckets:
        for i, copies in enumerate(bucket.rounds):
            packed, buffers = [c for c in copies if c.src != c.dst and not c.direct], {}
            for c in packed:
                for r in (c.src, c.dst):
                    buffers[r] = buffers.get(r, 0) + c.nbytes
            assert len(packed) <= 1 or max(buffers.values()) <= 4096
            assert i == 0 or len(packed) == len(copies)  # local and direct copies: round 0
    # deterministic: equal inputs, an equal plan (a sync keeps its own share: sync.rank_plan)
    assert build_plan(pieces, layout, 4096, None, RolloutLayout(1).engines(2)) == small


def test_a_sync_builds_its_plan_once_per_layout_and_shapes():
    """sync.rank_plan, which every sync calls: equal arguments find the same RankPlan without
    building again (metadata.Gathered compares its key only, never a piece), and any change of
    a rank's shapes (its digest), of the layout or of the bucket size builds another. The
    RankPlan is this rank's share of the very plan build_plan makes."""
    arch = _arch(num_layers=4, vocab_size=200)  # vLLM pads it to 256 rows
    pieces = layout_pieces(arch, ParallelDims(world_size=2, pp=2))
    digests = tuple(metadata.digest([p for p in pieces if p.rank == r]) for r in range(2))
    vllm = WeightLayout("vllm", 2)

    def find(key=("world", digests), layout=vllm, bucket=4096):
        return sync.rank_plan(arch, layout, metadata.Gathered(key, tuple(pieces)), bucket, (0, 0), 1)

    sync.rank_plan.cache_clear()
    first = find()
    assert find() is first and sync.rank_plan.cache_info().misses == 1
    plan = build_plan(pieces, tuple(sorted(vllm_layout(arch, RolloutLayout(1), 2).items())), 4096, (0, 0),
                      RolloutLayout(1).engines(2))
    mine = plan.tensors[1]
    assert [rounds for _, rounds in first.buckets] == list(plan.rank_work(1))
    assert [names for names, _ in first.buckets] == [
        tuple(t.name for t in mine if t.module in b.modules.get(1, ())) for b in plan.buckets]
    assert first.expected == {t.name: t.shape for t in mine} and first.shard_bytes == plan.shard_bytes(1)
    assert first.padded == {t.name for t in mine if t.covered < t.numel} != set()  # vocabulary rows
    others = [find(key=("world", (digests[0], digests[1] + 1))), find(layout=WeightLayout("vllm", 2, 2)),
              find(bucket=8192), find(key=("bridge", digests))]
    assert all(other is not first for other in others) and sync.rank_plan.cache_info().misses == 5


@pytest.mark.parametrize("seed", range(4))
def test_each_ranks_work_is_its_share_of_every_round(seed):
    """Plan.rank_work (what transport.exchange runs on a rank) is exactly the copies of each
    round that the rank sends or receives, in plan order, bucket by bucket."""
    rng = random.Random(seed)
    arch = _arch(num_layers=rng.choice([2, 4]), hidden_size=rng.choice([32, 512]),
                 ffn_hidden_size=rng.choice([64, 1024]))
    dims = ParallelDims(world_size=4, **rng.choice([dict(tp=2), dict(pp=2), dict(tp=2, pp=2)]))
    layout = tuple(sorted(vllm_layout(arch, RolloutLayout(rng.choice([1, 2])), 4).items()))
    plan = build_plan(layout_pieces(arch, dims), layout, rng.choice([4096, 2**18, 2**22]))
    assert arch.hidden_size == 512 or not any(c.direct for b in plan.buckets for c in b.copies)
    for rank in range(4):
        work = plan.rank_work(rank)
        assert len(work) == len(plan.buckets)
        for bucket, rounds in zip(plan.buckets, work):
            expected = [tuple(c for c in copies if rank in (c.src, c.dst)) for copies in bucket.rounds]
            assert rounds == tuple(r for r in expected if r)


@pytest.mark.parametrize("pieces,message", [
    ((Piece(0, "a", 0, 2, 0, False, (4, 4), "torch.float32"),), r"a: TP shards \[0\] of 2 are held"),
])
def test_incomplete_metadata_raises(pieces, message):
    with pytest.raises(ValueError, match=message):
        build_plan(pieces, ((0, ()),), 100)


def test_a_destination_the_source_cannot_fill_is_refused():
    arch = _arch()
    pieces = layout_pieces(arch, ParallelDims(world_size=1))
    other = vllm_layout(_arch(num_layers=3), RolloutLayout(1), 1)
    with pytest.raises(ValueError, match="missing .*decoder.layers.2"):
        build_plan(pieces, tuple(sorted(other.items())), 100)


@pytest.mark.parametrize("pp,rollout_tp,bucket", [(4, 2, 2**14), (2, 1, 2**14), (4, 1, 2**15), (8, 1, 2**13)])
def test_every_stage_sends_in_every_bucket_to_its_share_of_the_engines(pp, rollout_tp, bucket):
    """With PP, the engines' buckets read different stages (plan._engine_order): in each bucket
    the busiest sender sends about what the busiest receiver receives. With one order for every
    engine, a bucket's one stage sent to all engines: the senders' sums were ~pp/2 x higher."""
    arch, world = _arch(num_layers=8, hidden_size=64, ffn_hidden_size=128), 8
    rollout = RolloutLayout(rollout_tp)
    layout = tuple(sorted(vllm_layout(arch, rollout, world).items()))
    plan = build_plan(layout_pieces(arch, ParallelDims(world_size=world, pp=pp)), layout, bucket,
                      None, rollout.engines(world))
    busiest_sender = busiest_receiver = 0
    for b in plan.buckets:
        sent, received = {}, {}
        for c in b.copies:
            if c.src != c.dst:
                sent[c.src] = sent.get(c.src, 0) + c.nbytes
                received[c.dst] = received.get(c.dst, 0) + c.nbytes
        busiest_sender += max(sent.values(), default=0)
        busiest_receiver += max(received.values(), default=0)
    assert len(plan.buckets) >= 4
    assert busiest_sender <= 1.3 * busiest_receiver, (busiest_sender, busiest_receiver)
