"""Block-FP8 rollout engines (rollout.quantization fp8; megarl/rollout/vllm/fp8_engine.py) on the
CPU, through scripts/verify_sync.py --rollout-quantization fp8 --loader-parity: after a sync from
the bf16 actor, every engine tensor (FP8 codes and block scales, and the bf16 rest) is bit-equal
to what vLLM's own loader makes of the same weights saved as a block-FP8 checkpoint (quantized
apart, by models/hf/fp8_blocks.py), for a dense, a MoE and an MLA model at rollout TP1 and TP2;
and a layout whose slices are not whole blocks is refused before any work. The same syncs
quantize each tensor on its senders where every slab of it is whole 128 x 128 blocks, on the
engine rank otherwise (resharding/plan.py), and their transports move what the planner counts."""

import pytest

from megarl.models.hf.config import load_arch
from megarl.models.weights import fp8_layout
from megarl.models.weights.destination import RolloutLayout, vllm_layout
from megarl.models.weights.fp8_layout import check_fp8_dtype, check_fp8_layout, kept_in_bf16, misaligned
from megarl.resharding import cluster_plan as cp
from megarl.resharding.plan import FP8_WIRE, build_plan
from megarl.resharding.source_layout import layout_pieces
from megarl.rollout.config import RolloutConfig
from tests.launch import last_json, start
from tests.test_plan_sync import FIGURES, _train

TP2 = ["--tp", "2", "--ep", "2", "--etp", "1", "--rollout-tp", "2"]
CASES = {
    # name: (world size, model, flags, FP8 tensors per engine rank: codes and scale of each
    # quantized module)
    "dense_rollout_tp1": (1, "qwen3", [], 4 * 4 * 2),  # 4 layers x (qkv, o, gate_up, down)
    # DeepSeek-V3: MLA and MoE; a dense layer (fused_qkv_a, q_b, kv_b, o, gate_up, down), then a
    # MoE one (the same attention, the shared experts' gate_up and down, w13 and w2)
    "mla_moe_rollout_tp1": (1, "deepseek_v3_fp8_engine", [], (6 + 8) * 2),
    "moe_tp2_ep2_etp1_into_rollout_tp2": (2, "qwen3_moe_fp8_engine", TP2, 2 * 4 * 2),  # qkv, o, w13, w2
    "mla_moe_tp2_ep2_etp1_into_rollout_tp2": (2, "deepseek_v3_fp8_engine", TP2, (6 + 8) * 2),
}
FP8_MODELS = ("qwen3_moe_fp8_engine", "deepseek_v3_fp8_engine")
# FP8 tensors per engine rank its senders quantize; the others' slabs cut a block, so the engine
# rank quantizes them: qkv_proj, whose k and v heads (the tiny Qwen3's, 64 rows) and at TP2 its
# q heads (one per KV group, 64 rows) are read apart. Every MLA and expert slab is whole blocks.
SENDER_QUANTIZED = {"dense_rollout_tp1": 4 * 3, "mla_moe_rollout_tp1": 6 + 8,
                    "moe_tp2_ep2_etp1_into_rollout_tp2": 2 * 3,
                    "mla_moe_tp2_ep2_etp1_into_rollout_tp2": 6 + 8}


@pytest.fixture(scope="module")
def fp8_syncs(hf_models, tmp_path_factory):
    """get(case): the case's verify_sync report; the one-rank cases begun side by side at once."""
    from megarl.demo.tiny_checkpoint import make_named

    root = tmp_path_factory.mktemp("fp8")
    models = {**hf_models, **{name: make_named(name, str(root / name)) for name in FP8_MODELS}}
    started = {}

    def begin(case):
        world, model, flags, _ = CASES[case]
        if case not in started:
            started[case] = start("scripts/verify_sync.py", "--hf-dir", models[model], "--perturb", "0.05",
                                  "--dtype", "bfloat16", "--rollout-quantization", "fp8", "--loader-parity",
                                  "--max-logprob-diff", "2", *flags, nproc=world, timeout=900)
        return started[case]

    for case, (world, *_) in CASES.items():
        if world == 1:
            begin(case)

    def get(case):
        return last_json(begin(case).result())

    get.models = models
    return get


@pytest.mark.parametrize("case", list(CASES))
def test_synced_fp8_engine_equals_vllm_loading_the_fp8_checkpoint(case, fp8_syncs):
    world, _, _, fp8_tensors = CASES[case]
    result = fp8_syncs(case)
    assert result["weight_parity_max_abs_diff"] == [0.0] * world, result
    assert result["weight_parity_fp8_tensors"] == [fp8_tensors] * world, result
    assert result["params_synced"] == result["params_expected"] > 0, result
    # the fp32 tensors of the bf16 engine (gates, DeepSeek's routing bias) are those the planners count so
    assert result["engine_fp32_mismatches"] == [[]] * world, result
    # The sync did the work: the engine's dummy weights were far off; after it, the engine's
    # log-probs differ from the bf16 actor's by FP8 rounding alone (measured 0.33 to 0.95).
    assert result["max_abs_logprob_diff_before_sync"] >= 2.0, result
    assert result["max_abs_logprob_diff"] <= 0.5 * result["max_abs_logprob_diff_before_sync"], result


@pytest.mark.parametrize("case", list(CASES))
def test_fp8_sync_moves_codes_and_scales_where_the_planner_says(case, fp8_syncs):
    """The transport's own counts (SyncReport, as it posted each message) equal the planner's
    (cluster_plan.plan_cluster with quantization fp8: scripts/plan_sync.py --rollout-quantization
    fp8) rank by rank; which tensors the senders quantized is the plan's; between ranks only
    codes and scales travel (as bytes: torch.uint8), half the bf16 bytes of the routed experts'
    halves the other rank holds, counted here from the shapes."""
    world, model, flags, _ = CASES[case]
    result = fp8_syncs(case)
    assert result["quantized_by_senders"] == [SENDER_QUANTIZED[case]] * world, result
    arch = load_arch(fp8_syncs.models[model], "bfloat16")
    values = dict(zip(flags[::2], flags[1::2]))
    train = _train([x for k, v in values.items() if k != "--rollout-tp" for x in (k, v)]) or "tp=1"
    planned = cp.plan_cluster(arch, cp.train_dims(train, world), cp.rollout_layout(
        f"tp={values.get('--rollout-tp', 1)}"), world, 256 * 2**20, quantization="fp8")
    assert planned.buckets == result["buckets"] == 1
    assert planned.quantized_by_senders == sum(result["quantized_by_senders"])
    for key, attr in FIGURES.items():
        # the peak included: vLLM holds the MoE gates and DeepSeek's routing bias in fp32 in a bf16
        # engine (rollout/vllm/fp32_router.py), and the planner counts them so (engine_fp32)
        assert [getattr(planned.ranks[r], attr) for r in range(world)] == result[key], (key, result)
    if world == 1:
        assert result["bytes_received"] == [0] and result["local_bytes"] == result["shard_bytes"]
        return
    # each rank receives the other's routed experts' halves: w13's gate and up rows, w2's columns
    w, h = arch.moe_ffn_hidden_size // 2, arch.hidden_size
    moe_layers = arch.num_layers - arch.first_dense_layers
    codes = arch.num_experts // 2 * moe_layers * 3 * w * h
    scales = arch.num_experts // 2 * moe_layers * 3 * (w // 128) * (h // 128) * 4
    for rank in range(world):
        assert result["received_from"][rank] == [[1 - rank, "torch.uint8", codes + scales]], result
        assert result["sent_to"][rank] == [[1 - rank, "torch.uint8", codes + scales]], result
    assert codes + scales < 0.51 * 2 * codes  # against the bf16 the receivers quantized from before


def test_the_plan_quantizes_on_the_sender_where_its_slabs_are_whole_blocks(hf_models):
    """The pure plan of the tiny Qwen3 from training TP2 into two rollout-TP1 engines: rank 0
    receives half of every layer from rank 1. Its qkv_proj's k and v heads (64 rows) cut blocks:
    the whole tensor comes in bf16, for the engine rank to quantize, its q rows too; o_proj,
    gate_up_proj and down_proj halves are whole blocks: sent as codes and scales. The bytes are
    counted here from the shapes; a float32 trainer's slabs all go to the engine rank."""
    arch = load_arch(hf_models["qwen3"], "bfloat16")
    dims, rollout = cp.train_dims("tp=2", 2), RolloutLayout(1)
    plan = cp.plan_cluster(arch, dims, rollout, 2, 256 * 2**20, quantization="fp8")
    assert (plan.quantized_by_senders, plan.quantized_by_receivers) == (2 * 4 * 3, 2 * 4)
    layout = fp8_layout.quantized_layout(arch, rollout, vllm_layout(arch, rollout, 2))
    copies = [c for b in build_plan(layout_pieces(arch, dims), tuple(sorted(layout.items())), 2**28).buckets
              for c in b.copies if c.dst == 0 and c.src == 1]
    kinds = {(c.tensor.split(".")[-2], c.fp8, c.wire) for c in copies if ".layers." in c.tensor}
    assert kinds == {("qkv_proj", False, "torch.bfloat16"), ("o_proj", True, FP8_WIRE),
                     ("gate_up_proj", True, FP8_WIRE), ("down_proj", True, FP8_WIRE)}
    h, d, f, layers = arch.hidden_size, arch.head_dim, arch.ffn_hidden_size, arch.num_layers
    assert h == f == arch.num_heads * d == 256  # so each half below is two whole 128 x 128 blocks
    half = h * (h // 2)  # codes of half of o_proj's columns, gate's or up's rows, down_proj's columns
    qkv = (arch.num_heads + 2 * arch.num_kv_heads) // 2 * d * h * 2  # the other KV group, bf16
    per_layer = qkv + 4 * (half + 2 * 4)  # and the o, gate, up and down halves with their 2 scales
    vocab = (arch.vocab_size - 128) * h * 2 * 2  # embeddings and lm_head rows past rank 0's 128
    assert plan.ranks[0].received == layers * per_layer + vocab
    unquantized = cp.plan_cluster(arch, dims, rollout, 2, 256 * 2**20)
    assert unquantized.ranks[0].received == layers * (qkv + 4 * half * 2) + vocab
    wide = cp.plan_cluster(load_arch(hf_models["qwen3"], "float32"), dims, rollout, 2, 256 * 2**20,
                           quantization="fp8")
    assert (wide.quantized_by_senders, wide.quantized_by_receivers) == (0, 2 * 4 * 4)


def test_what_an_fp8_engine_cannot_hold_is_refused_by_name(hf_models):
    moe = load_arch(hf_models["qwen3_moe"])  # expert width 64, KV heads of 64 rows per rank at TP2
    assert misaligned(moe, RolloutLayout(1)) == ["expert width per rank = 64"]
    with pytest.raises(ValueError, match=r"rollout tp 2.*k and v rows per rank = 64; expert width per "
                                         r"rank = 32.*multiples of 128"):
        check_fp8_layout(moe, RolloutLayout(2))
    assert misaligned(load_arch(hf_models["qwen3"]), RolloutLayout(1)) == []
    deepseek = load_arch(hf_models["deepseek_v3"])
    assert misaligned(deepseek, RolloutLayout(1)) == [
        "q_lora_rank (fused_qkv_a_proj's first part) = 64", "expert width per rank = 64"]
    # a dense MLP or shared expert not in whole blocks stays bf16 instead: shared width 64 here
    # (the dense layer's 256 is whole blocks at TP1 and TP2, not at TP4)
    shared = [f"model.layers.{n}.mlp.shared_experts.{p}" for n in (1, 2, 3) for p in ("gate_proj", "up_proj",
                                                                                     "down_proj")]
    assert sorted(kept_in_bf16(deepseek, RolloutLayout(2))) == sorted(shared)
    dense = [f"model.layers.0.mlp.{p}" for p in ("gate_proj", "up_proj", "down_proj")]
    assert sorted(kept_in_bf16(deepseek, RolloutLayout(4))) == sorted(dense + shared)
    assert misaligned(load_arch(hf_models["qwen3_next"]), RolloutLayout(1))[0].startswith("family qwen3_next")
    with pytest.raises(ValueError, match=r"rollout.quantization='int8' is not supported: choose one of "
                                         r"\('none', 'fp8'\)"):
        RolloutConfig(quantization="int8")
    with pytest.raises(ValueError, match="model dtype 'float32'.*bfloat16"):
        check_fp8_dtype("float32")


def test_plan_sync_counts_fp8_engine_bytes(hf_models, capsys, tmp_path):
    """scripts/plan_sync.py --rollout-quantization fp8 on the tiny Qwen3 at rollout TP2 (its KV
    heads made 4): each engine rank's FP8 codes and scales equal those of the tensors its block-FP8
    checkpoint would quantize (counted here from the checkpoint itself), halved by TP; a layout
    whose slices are not whole blocks is refused."""
    import importlib.util
    import json
    import os

    from safetensors import safe_open

    from megarl.models.hf import fp8_blocks

    hf_dir = hf_models["qwen3"]
    spec = importlib.util.spec_from_file_location("plan_sync", os.path.join("scripts", "plan_sync.py"))
    plan_sync = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(plan_sync)
    config = tmp_path / "config.json"
    with open(os.path.join(hf_dir, "config.json")) as f:
        config.write_text(json.dumps({**json.load(f), "num_key_value_heads": 4}))
    codes = scales = 0
    with safe_open(os.path.join(hf_dir, "model.safetensors"), "pt") as f:
        for name in f.keys():
            shape = tuple(f.get_slice(name).get_shape())
            if name.endswith(("k_proj.weight", "v_proj.weight")):  # KV heads 2 -> 4
                shape = (2 * shape[0], shape[1])
            if fp8_blocks.is_quantized(name, shape, {}):
                codes += shape[0] * shape[1]
                scales += -(-shape[0] // 128) * -(-shape[1] // 128) * 4
    summary = plan_sync.main(["--hf-config", str(config), "--train", "tp=2", "--rollout", "tp=2",
                              "--nodes", "1", "--gpus-per-node", "2", "--dtype", "bfloat16",
                              "--rollout-quantization", "fp8"])
    fp8 = summary["fp8"]
    assert fp8["fp8_code_bytes_per_rank"] == codes // 2, fp8
    assert fp8["fp8_scale_bytes_per_rank"] == scales // 2, fp8
    assert fp8["kept_unquantized_modules"] == 0, fp8
    rest = fp8["unquantized_engine_bytes_per_rank"] - 2 * codes // 2
    assert fp8["engine_bytes_per_rank"] == codes // 2 + scales // 2 + rest, fp8
    assert "FP8 engines: each engine rank holds" in capsys.readouterr().out
    with pytest.raises(SystemExit):  # KV heads of 64 rows per rank: refused before planning
        plan_sync.main(["--hf-config", hf_dir, "--train", "tp=2", "--rollout", "tp=2", "--nodes", "1",
                        "--gpus-per-node", "2", "--dtype", "bfloat16", "--rollout-quantization", "fp8"])
    assert "k and v rows per rank = 64" in capsys.readouterr().err
