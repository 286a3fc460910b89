"""The cluster planner (megarl/resharding/cluster_plan.py, scripts/plan_sync.py) in one process: its
per-rank figures are the plan's own, its seconds are the stated arithmetic, planning one engine
per placement gives every engine's receiving figures, and bad flags fail with the flag named.
tests/test_plan_sync.py checks the same figures against real syncs."""

import importlib.util
import json
import os

import pytest

from megarl.models.hf.config import ModelArch
from megarl.models.weights.destination import DestTensor, Region, RolloutLayout, vllm_layout
from megarl.parallel_state.dims import ParallelDims
from megarl.resharding import cluster_plan as cp
from megarl.resharding import gpu_kinds
from megarl.resharding.plan import Bucket, Copy, Plan, build_plan
from megarl.resharding.source_layout import layout_pieces
from tests.published_configs import DEEPSEEK_V3, KIMI_K2, QWEN3_30B_A3B, QWEN3_32B, QWEN3_235B_A22B

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _moe(**kw) -> ModelArch:
    base = dict(family="qwen3_moe", architecture="Qwen3MoeForCausalLM", vocab_size=256, hidden_size=32,
                ffn_hidden_size=64, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=8, norm_eps=1e-6,
                rope_theta=1e4, max_position_embeddings=64, tie_embeddings=False, qkv_bias=False,
                qk_norm=True, dtype="bfloat16", num_experts=8, moe_topk=2, moe_ffn_hidden_size=16)
    return ModelArch(**{**base, **kw})


def _script():
    spec = importlib.util.spec_from_file_location("plan_sync", os.path.join(ROOT, "scripts", "plan_sync.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("train,rollout,nodes", [
    ("tp=2,pp=2,ep=2", "tp=2", 2), ("tp=2,ep=4,etp=1", "tp=4", 2), ("pp=2,ep=4", "tp=2,ep=2", 4),
    ("tp=2,pp=2,ep=2,etp=1", "tp=1", 2)])
def test_per_rank_figures_are_the_plans(train, rollout, nodes):
    arch = _moe()
    dims = cp.train_dims(train, nodes * 4)
    layout = vllm_layout(arch, cp.rollout_layout(rollout), dims.world_size)
    node_of = tuple(r // 4 for r in range(dims.world_size))
    plan = build_plan(layout_pieces(arch, dims), tuple(sorted(layout.items())), 2**14, node_of)
    stats, timing = cp.plan_stats(plan, node_of, 2)
    assert timing.rounds == sum(len(b.rounds) for b in plan.buckets)
    inter = 0
    for rank in range(dims.world_size):
        st = stats[rank]
        assert (st.received, st.sent, st.shard_bytes) == (plan.received(rank), plan.sent(rank),
                                                          plan.shard_bytes(rank))
        inter += st.recv_inter
        remote = [c for b in plan.buckets for c in b.copies if c.dst == rank != c.src]
        assert st.recv_inter == sum(c.nbytes for c in remote if node_of[c.src] != node_of[rank])
        assert 0 < st.peak_bytes
    assert inter == sum(stats[r].sent_inter for r in range(dims.world_size))
    assert (inter > 0) == (dims.pp > 1)  # the stages sit on different nodes


def _copy(src, dst, numel, dim=0, tensor="m.w", itemsize_dtype="torch.float32"):
    return Copy(src, dst, "c", 0, dim, 0, 1, tensor, None, 0, numel, itemsize_dtype)


def test_seconds_arithmetic_by_hand():
    """Ranks 0, 1 on node 0, rank 2 on node 1. One round: rank 1 sends rank 0 a direct slab of
    4e6 bytes over NVLink, rank 2 sends it two packed slabs of 1e5 bytes over InfiniBand (one
    message), and rank 0 copies 3e6 bytes locally. Packing has its own rate (0.5 GB/s here):
    unpacking goes at the copy rate (hbm_gbps), as the transport unpacks with the batched copy."""
    links = cp.Links(nvlink_gbps=0.1, ib_gbps=0.01, hbm_gbps=1.0, pack_gbps=0.5, message_us=10,
                     copy_us=2, round_us=100)
    copies = (_copy(1, 0, 1_000_000), _copy(2, 0, 25_000, dim=1), _copy(2, 0, 25_000, dim=1),
              _copy(0, 0, 750_000))
    tensors = {0: (DestTensor("m.w", (5_000, 1_000), (Region("c", 0, 0, 5_000, 0),)),)}
    plan = Plan((Bucket({0: ("m",)}, (copies,)),), tensors)
    stats, timing = cp.plan_stats(plan, (0, 0, 1), 4, links)
    r0, r1, r2 = stats[0], stats[1], stats[2]
    assert (r0.recv_intra, r0.recv_inter, r0.local_bytes, r0.packed_bytes) == (4e6, 2e5, 3e6, 2e5)
    assert (r0.messages, r0.messages_received, r1.messages, r2.messages) == (0, 2, 1, 1)
    # rank 0: pre: 1 local copy x 2 us + 3e6 / 1e9; network: receive 4e6 / 0.1e9 + 2e5 / 0.01e9
    # + 2 messages x 10 us; post: 3 received copies x 2 us + 2e5 unpacked / 1e9; a 100 us round
    pre, network, post = 2e-6 + 3e-3, 0.04 + 0.02 + 2e-5, 6e-6 + 2e-4
    expect0 = pre + network + post + 1e-4
    assert r0.seconds == pytest.approx(expect0)
    assert (r0.terms["pre"], r0.terms["network"], r0.terms["post"]) == pytest.approx((pre, network, post))
    # rank 2: pre: 2 copies x 2 us + packs 2e5 bytes at 0.5 GB/s; send 2e5 / 0.01e9 + 1 message;
    # no post
    assert r2.seconds == pytest.approx(4e-6 + 4e-4 + 0.02 + 1e-5 + 1e-4)
    assert r2.terms["pre"] == pytest.approx(4e-6 + 4e-4)
    # Rank 0 posts last (its pre is the longest) and has the most to receive: it ends the sync.
    assert timing.seconds == timing.seconds_barrier == timing.seconds_rank_bound == pytest.approx(expect0)
    # Peak: the opened tensor (5e6 elements x 4 bytes) + the round's buffers (2e5 packed bytes).
    assert r0.peak_bytes == 20_000_000 + 200_000


def _measured():
    with open(os.path.join(ROOT, "docs", "gpu", "sync_copies.json")) as f:
        return json.load(f)


def test_each_kinds_constants_are_its_measurements():
    """gpu_kinds.KINDS is what bench/bench_sync_copies.py --device cuda measured against megarl's
    transport (docs/gpu/sync_copies.json: the H200's line as gpu_check.json holds it, 2026-11-28,
    ../shared/gpu/2026-11-28/; the H100's as DESIGN.md records it, 2026-11-26), rounded: a Copy
    to 0.1 us, the bandwidths to 0.5%. On the H100 the model's charge for a slab, copy_us + bytes
    / hbm_gbps, is within 5% of both Copy measurements (393 KB and 3.67 MB slabs). The defaults of
    Links are the H100's, and the script's help gives every kind's figures."""
    measured = _measured()
    assert set(gpu_kinds.KINDS) == {"h100", "h200"} <= set(measured)
    for name, kind in gpu_kinds.KINDS.items():
        result = measured[name]["result"]
        assert result["slab_bytes"] == 393_216, name
        assert kind.copy_us == pytest.approx(result["batched_us_per_copy"], abs=0.05), name
        assert kind.pack_gbps == pytest.approx(result["pack_GBps"], rel=0.005), name
        assert kind.hbm_gbps == pytest.approx(result["plain_copy_GBps"], rel=0.005), name
        assert kind.device in measured[name]["machine"], name
    assert measured["h200"]["result"]["batched_us_per_copy"] == pytest.approx(11.7428, abs=1e-4)
    h100 = gpu_kinds.KINDS["h100"]
    for result in (measured["h100"]["result"], measured["h100"]["larger_slabs"]["result"]):
        charged_us = h100.copy_us + result["slab_bytes"] / (h100.hbm_gbps * 1e9) * 1e6
        assert charged_us == pytest.approx(result["batched_us_per_copy"], rel=0.05), result
    assert cp.Links() == cp.Links.of(h100) and cp.Links().gpu == "h100"
    help_text = _script()._parser().format_help()
    for flag, name in (("--copy-us", "copy_us"), ("--pack-gbps", "pack_gbps"), ("--hbm-gbps", "hbm_gbps")):
        row = next(line for line in help_text.splitlines() if line.lstrip().startswith(flag + " "))
        assert row.split()[1:3] == [f"{getattr(k, name):g}" for k in gpu_kinds.KINDS.values()], row


def test_the_gpu_kind_is_the_flags_else_the_visible_devices():
    choose = gpu_kinds.choose
    h100, h200 = gpu_kinds.KINDS["h100"], gpu_kinds.KINDS["h200"]
    assert choose(None, "NVIDIA H200") == (h200, "the visible GPU, NVIDIA H200")
    assert choose(None, "NVIDIA H100 80GB HBM3")[0] == h100
    assert choose("h200", "NVIDIA H100 80GB HBM3") == (h200, "--gpu h200")  # the flag wins
    assert choose("H100", "NVIDIA A100-SXM4-80GB")[0] == h100  # over an unknown device too
    kind, how = choose(None, None)
    assert kind == h100 and how.startswith("the default: no GPU visible") and "--gpu h100|h200" in how
    for device in ("NVIDIA A100-SXM4-80GB", "NVIDIA GH200 480GB"):  # GH200: no H200, not measured
        with pytest.raises(ValueError, match=rf"GPU '{device}' has no measured sync constants "
                                             r"\(kinds: h100, h200\): pass --gpu h100\|h200"):
            choose(None, device)
    with pytest.raises(ValueError, match=r"--gpu 'a100': no such kind; expected one of h100, h200"):
        choose("a100", "NVIDIA H200")
    # the script's own path from its flags and a device name to the plan's constants
    script = _script()
    parser = script._parser()
    base = ["--hf-config", "x", "--train", "tp=1", "--rollout", "tp=1", "--nodes", "1"]
    links, how = script.links_of(parser.parse_args(base), "NVIDIA H200")
    assert links == cp.Links.of(h200) and how == "the visible GPU, NVIDIA H200"
    flagged = parser.parse_args(base + ["--gpu", "h100", "--copy-us", "25"])
    links, how = script.links_of(flagged, "NVIDIA H200")
    assert (links.gpu, links.copy_us, links.pack_gbps, how) == ("h100", 25.0, 222.0, "--gpu h100")
    assert links.departures() == ["copy_us"]
    with pytest.raises(ValueError, match="has no measured sync constants"):
        script.links_of(parser.parse_args(base), "Tesla V100-SXM2-32GB")


@pytest.mark.parametrize("kind,copy_us,pack_gbps,hbm_gbps", [("h100", 7.3, 222.0, 1482.0),
                                                              ("h200", 11.7, 95.0, 2086.0)])
def test_a_plans_seconds_by_hand_for_each_kind(kind, copy_us, pack_gbps, hbm_gbps):
    """One round on one node: rank 1 packs two 393,216-byte slabs (a Qwen3-30B-A3B TP8 expert
    slab) into one message to rank 0 and sends it a 2 MB row slab directly; rank 0 copies 3 MB
    locally. Rank 0's seconds written out with the kind's constants as measured (the numbers in
    the parametrization, not the table's): pre, network (receive: the bytes over NVLink + 2
    messages), post, one round."""
    links = cp.Links.of(gpu_kinds.KINDS[kind])
    slab = 393_216 // 2  # elements of a bf16 slab
    copies = (_copy(1, 0, 1_000_000, itemsize_dtype="torch.bfloat16"),
              _copy(1, 0, slab, dim=1, itemsize_dtype="torch.bfloat16"),
              _copy(1, 0, slab, dim=1, itemsize_dtype="torch.bfloat16"),
              _copy(0, 0, 1_500_000, itemsize_dtype="torch.bfloat16"))
    plan = Plan((Bucket({0: ("m",)}, (copies,)),), {})
    stats, timing = cp.plan_stats(plan, (0, 0), 2, links)
    r0, r1 = stats[0], stats[1]
    assert (r0.recv_intra, r0.local_bytes, r0.packed_received, r0.messages_received) == (
        2_786_432, 3_000_000, 786_432, 2)
    pre = 1 * copy_us * 1e-6 + 3_000_000 / (hbm_gbps * 1e9)
    network = 2_786_432 / 450e9 + 2 * 10e-6
    post = 3 * copy_us * 1e-6 + 786_432 / (hbm_gbps * 1e9)
    assert r0.seconds == pytest.approx(pre + network + post + 100e-6, rel=1e-12)
    assert r1.terms["pre"] == pytest.approx(3 * copy_us * 1e-6 + 786_432 / (pack_gbps * 1e9), rel=1e-12)
    assert timing.seconds == pytest.approx(max(r1.terms["pre"], pre) + network + post + 100e-6, rel=1e-12)


def test_rounds_run_in_parallel_unless_they_share_a_rank():
    links = cp.Links(nvlink_gbps=1.0, message_us=0, copy_us=0, round_us=0)
    big = 2**20 // 4  # a direct message of 1 MiB
    apart = Plan((Bucket({0: ("m",)}, ((_copy(0, 1, big),), (_copy(2, 3, 2 * big),))),), {})
    chained = Plan((Bucket({0: ("m",)}, ((_copy(0, 1, big),), (_copy(1, 2, 2 * big),))),), {})
    one, two = 2**20 / 1e9, 2 * 2**20 / 1e9
    _, t = cp.plan_stats(apart, (0,) * 4, 4, links)
    assert (t.seconds, t.seconds_barrier, t.seconds_rank_bound) == pytest.approx((two, one + two, two))
    _, t = cp.plan_stats(chained, (0,) * 4, 4, links)
    assert (t.seconds, t.seconds_barrier, t.seconds_rank_bound) == pytest.approx((one + two,) * 3)


def test_one_engine_per_placement_gives_every_engines_receiving_figures():
    arch = _moe(num_layers=2)
    for train, rollout, nodes in (("tp=2,pp=2,ep=2", "tp=4", 4), ("tp=2,ep=4,etp=1", "tp=2", 2)):
        dims, ro = cp.train_dims(train, nodes * 4), cp.rollout_layout(rollout)
        full = cp.plan_cluster(arch, dims, ro, 4, 2**14)
        part = cp.plan_cluster(arch, dims, ro, 4, 2**14, max_regions=0)
        assert full.complete and not part.complete and len(part.engines_planned) < part.engines
        assert part.summary()["engines_planned"] == len(part.engines_planned)
        planned = {cp._signature(dims, range(e * ro.size, (e + 1) * ro.size), 4): e
                   for e in part.engines_planned}
        for engine in range(full.engines):
            ranks = range(engine * ro.size, (engine + 1) * ro.size)
            twin = planned[cp._signature(dims, ranks, 4)]
            for rank in ranks:
                a, b = full.ranks[rank], part.ranks[twin * ro.size + rank % ro.size]
                for key in ("recv_intra", "recv_inter", "local_bytes", "shard_bytes"):
                    assert getattr(a, key) == getattr(b, key), (train, rollout, rank, key)
        for key in ("max_bytes_received_per_rank", "max_bytes_inter_node_received_per_rank",
                    "max_shard_bytes_per_rank"):
            assert full.summary()[key] == part.summary()[key], key
        assert "lower bounds" in part.note()


@pytest.mark.parametrize("train,message", [
    ("tp=2,tq=4", "--train 'tp=2,tq=4': unknown key 'tq'"),
    ("tp=two", "tp='two' must be a positive integer"),
    ("tp=0", "tp='0' must be a positive integer"),
    ("tp", "'tp' is not key=value"),
    ("tp=2,tp=2", "tp given twice"),
    ("tp=3", r"tp\(3\) \* pp\(1\) \* cp\(1\) \* dp\(\?\) must equal world size 16"),
    ("tp=2,dp=4", "dp=4, but world 16 / .* = 8"),
])
def test_bad_train_layouts_name_the_problem(train, message):
    with pytest.raises(ValueError, match=message):
        cp.train_dims(train, 16)


def test_bad_rollouts_and_model_layouts_name_the_problem():
    with pytest.raises(ValueError, match="--rollout 'pp=2': unknown key 'pp'; expected one of tp, ep"):
        cp.rollout_layout("pp=2")
    with pytest.raises(ValueError, match="rollout ep 3: .* multiple of the rollout tp"):
        cp.rollout_layout("tp=2,ep=3")
    arch = _moe()
    with pytest.raises(ValueError, match="rollout tp 8 must divide the 4 attention heads"):
        cp.plan_cluster(arch, ParallelDims(16, tp=2), RolloutLayout(8), 8, 2**20)
    with pytest.raises(ValueError, match="gpus per node 3 must divide the world size 16"):
        cp.plan_cluster(arch, ParallelDims(16, tp=2), RolloutLayout(2), 3, 2**20)
    with pytest.raises(ValueError, match="num_experts|divisible"):
        cp.plan_cluster(arch, ParallelDims(16, ep=16), RolloutLayout(2), 8, 2**20)
    with pytest.raises(ValueError, match="--dtype 'fp8'"):
        cp.arch_of(QWEN3_30B_A3B, "fp8")
    with pytest.raises(ValueError, match="ib_gbps must be positive"):
        cp.Links(ib_gbps=0)


def test_the_script_prints_one_json_object_last(tmp_path, capsys):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(QWEN3_30B_A3B | {"num_hidden_layers": 2, "vocab_size": 4096}))
    plan_sync = _script()
    argv = ["--hf-config", str(tmp_path), "--train", "tp=2,pp=2,ep=2,etp=1", "--rollout", "tp=4",
            "--nodes", "2", "--gpus-per-node", "4", "--bucket-mb", "64"]
    summary = plan_sync.main(argv)
    lines = capsys.readouterr().out.strip().splitlines()
    last = json.loads(lines[-1])
    assert last == json.loads(json.dumps(summary))
    for key in ("seconds", "max_bytes_received_per_rank", "max_bytes_inter_node_per_rank", "messages",
                "peak_bytes_per_rank", "engines", "engines_planned", "world", "model_bytes",
                "max_shard_bytes_per_rank", "assumptions", "seconds_rank_bound", "seconds_barrier"):
        assert key in last, key
    assert last["world"] == 8 and last["engines"] == last["engines_planned"] == 2
    assert last["seconds_rank_bound"] <= last["seconds"] <= last["seconds_barrier"]
    assert last["max_bytes_inter_node_per_rank"] > 0 and last["messages"] > 0
    assert any(line.startswith("busiest rank, whole sync: rank ") for line in lines)
    here, how = gpu_kinds.choose(None, gpu_kinds.visible_device())  # no GPU on CI: the default
    assert last["gpu"] | {"chosen_by": how} == last["gpu"] and last["gpu"]["kind"] == here.name
    assert f"GPU constants: {here.describe()}; chosen by {how}" in lines
    h200 = plan_sync.main(argv + ["--gpu", "h200"])
    assert h200["gpu"] == {"kind": "h200", "measured_on": "NVIDIA H200", "copy_us": 11.7, "pack_gbps": 95.0,
                           "hbm_gbps": 2086.0, "set_apart": [], "chosen_by": "--gpu h200",
                           "measured": gpu_kinds.KINDS["h200"].measured}
    assert h200["assumptions"]["copy_us"] == 11.7 and h200["seconds"] != last["seconds"]
    assert h200["max_bytes_received_per_rank"] == last["max_bytes_received_per_rank"]


def test_the_lora_plan_puts_every_adapter_on_every_engine_rank(capsys):
    """--lora on a dense model: the adapters-only sync, its bytes PEFT's shapes counted by hand
    (rank 16 on q, k, v, o, gate, up, down of 64 layers, bf16), each engine rank taking them all in
    once; on a MoE model, the same adapters-only sync merged by the engine, and the base each engine
    rank keeps for it: every layer's attention and experts (rollout TP2: half of each), by hand."""
    plan_sync, r = _script(), 16
    args = ["--train", "tp=4,pp=2", "--rollout", "tp=4", "--nodes", "2", "--lora", f"rank={r}"]
    summary = plan_sync.main(["--hf-config", os.path.join(ROOT, "docs", "configs", "qwen3-32b.json"), *args])
    hidden, q, kv, ffn = 5120, 64 * 128, 8 * 128, 25600
    per_layer = r * ((hidden + q) + 2 * (hidden + kv) + (q + hidden) + 2 * (hidden + ffn) + (ffn + hidden))
    lora = summary["lora"]
    assert lora["slots"] and lora["adapter_bytes"] == 64 * per_layer * 2, lora
    assert lora["receiver_bytes"] == [lora["adapter_bytes"]] * 2 and lora["receivers"] == 16, lora
    assert 0 < lora["seconds"] < summary["seconds"] / 10, (lora["seconds"], summary["seconds"])
    assert "each later one moves the adapters alone" in capsys.readouterr().out
    moe = plan_sync.main(["--hf-config", os.path.join(ROOT, "docs", "configs", "qwen3-30b-a3b.json"),
                          "--train", "tp=2", "--rollout", "tp=2", "--nodes", "1", "--lora", "rank=8"])
    lora = moe["lora"]
    assert not lora["slots"] and "MoE" in lora["why"] and lora["receiver_bytes"][0] == lora["adapter_bytes"]
    hidden, q, kv, experts, width = 2048, 32 * 128, 4 * 128, 128, 768  # docs/configs/qwen3-30b-a3b.json
    per_layer = hidden * (q + 2 * kv) + q * hidden + experts * 3 * hidden * width
    assert lora["kept_base_bytes"] == 48 * per_layer * 2 // 2, lora
    assert "merged by the engine" in capsys.readouterr().out


@pytest.mark.parametrize("flags,message", [
    (["--train", "tp=2,bogus=1"], "unknown key 'bogus'"),
    (["--lora", "rank=8,width=3"], "'width=3' is not rank=, alpha= or targets="),
    (["--rollout", "tp=3"], "rollout tp 3 must divide the 32 attention heads"),
    (["--nodes", "0"], "--nodes 0 and --gpus-per-node 8 must be positive"),
    (["--hf-config", "/nonexistent/config.json"], "no such file"),
    (["--gpu", "a100"], "--gpu 'a100': no such kind; expected one of h100, h200"),
])
def test_the_script_refuses_bad_flags(flags, message, capsys, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(QWEN3_30B_A3B))
    args = {"--hf-config": str(tmp_path), "--train": "tp=2", "--rollout": "tp=2", "--nodes": "1"}
    args.update(dict(zip(flags[::2], flags[1::2])))
    with pytest.raises(SystemExit) as exit_info:
        _script().main([item for pair in args.items() for item in pair])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_published_config_files_are_the_published_configs():
    for name, config in (("qwen3-30b-a3b", QWEN3_30B_A3B), ("qwen3-235b-a22b", QWEN3_235B_A22B),
                         ("qwen3-32b", QWEN3_32B),
                         ("deepseek-v3", DEEPSEEK_V3), ("kimi-k2", KIMI_K2)):
        with open(os.path.join(ROOT, "docs", "configs", f"{name}.json")) as f:
            assert json.load(f) == config, name
    arch = cp.arch_of(QWEN3_235B_A22B)
    shape = (arch.num_layers, arch.num_experts, arch.moe_ffn_hidden_size, arch.hidden_size)
    assert shape == (94, 128, 1536, 4096)
    kimi = cp.arch_of(KIMI_K2)
    assert (kimi.num_layers, kimi.num_experts, kimi.num_heads, kimi.first_dense_layers) == (61, 384, 64, 1)
