"""LoRA adapters (megarl/models/lora/adapters.py, peft_io.py) against HF transformers + PEFT on the same base
and adapters: log-probs (<= 1e-4 abs) and adapter gradients (<= 1e-4 relative) at single, TP2 (with
sequence parallel), PP2, CP2, EP2 (expert adapters) and DeepSeek-V3's MLA; PEFT -> megarl -> PEFT
bit-exact at each layout; adapters on some projections of a fused linear (PEFT's default q_proj and
v_proj, up_proj alone, ranks and alphas mixed by rank_pattern); and the refusals."""

import json
import os

import pytest
import torch

from tests.launch import by_layout

# model -> what PEFT adapts on it (its own names: target_modules, and target_parameters for the
# fused routed experts of transformers 5). DeepSeek-V3: MLA's five projections and the experts.
PEFT_TARGETS = {
    "qwen3": (["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], None),
    "qwen3_moe": (["q_proj", "k_proj", "v_proj", "o_proj"],
                  ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]),
    "deepseek_v3": (["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"],
                    ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]),
    # gate_proj and up_proj named too: PEFT widens the fused gate_up's adapter to rank 2r, alpha
    # 2 alpha (its rank_pattern and alpha_pattern)
    "qwen3_moe_widened": (["q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"],
                          ["mlp.experts.gate_up_proj"]),
    # Some projections of a fused linear: PEFT's own default for Llama and Qwen (target_modules None:
    # q_proj and v_proj, not k_proj), up_proj without gate_proj, and ranks and alphas mixed inside
    # the fused QKV (PEFT_PATTERNS); DeepSeek-V3's q_a_proj without kv_a_proj_with_mqa, which vLLM
    # fuses with it.
    "qwen3_default": (None, None),
    "qwen3_up": (["up_proj"], None),
    "qwen3_moe_ranks": (["q_proj", "v_proj", "o_proj"], ["mlp.experts.down_proj"]),
    "deepseek_v3_partial": (["q_a_proj", "kv_b_proj"], ["mlp.experts.gate_up_proj"]),
}
# adapter -> (rank_pattern, alpha_pattern) given to PEFT
PEFT_PATTERNS = {"qwen3_moe_ranks": ({"v_proj": 2, "o_proj": 8}, {"v_proj": 2}),
                 "deepseek_v3_partial": ({"kv_b_proj": 2}, {})}
# adapter -> the model it is on (default: its own name)
BASE = {"qwen3_moe_widened": "qwen3_moe", "qwen3_default": "qwen3", "qwen3_up": "qwen3",
        "qwen3_moe_ranks": "qwen3_moe", "deepseek_v3_partial": "deepseek_v3"}
LAYOUTS = {
    # name: (world size, ParallelDims fields, models)
    "single": (1, {}, list(PEFT_TARGETS)),
    "tp2": (2, {"tp": 2}, ["qwen3", "qwen3_default", "qwen3_up"]),
    "pp2": (2, {"pp": 2}, ["qwen3", "qwen3_default", "deepseek_v3", "deepseek_v3_partial"]),
    "cp2": (2, {"cp": 2}, ["qwen3"]),
    "ep2": (2, {"ep": 2}, ["qwen3_moe", "qwen3_moe_ranks"]),
    "tp2_ep2_etp1": (2, {"tp": 2, "ep": 2, "etp": 1}, ["qwen3_moe", "qwen3_moe_ranks", "deepseek_v3"]),
}
CASES = [(layout, model) for layout, (_, _, models) in LAYOUTS.items() for model in models]


# The weight sync of an adapted actor (scripts/verify_sync.py --lora-init): name -> (world size, adapter,
# flags). Routed-expert adapters and some of the fused QKV's into one engine; TP2 (sequence parallel)
# into rollout TP2.
SYNC_CASES = {
    "single_moe": (1, "qwen3_moe_ranks", []),
    "tp2_into_rollout_tp2": (2, "qwen3", ["--tp", "2", "--rollout-tp", "2"]),
}


def make_adapter(hf_dir: str, out: str, model: str, seed: int = 0) -> str:
    """A PEFT LoRA folder on hf_dir with random A and B (init_lora_weights=False: a zero B would
    hide every error in A's path and give A no gradient), saved by PEFT itself."""
    import peft
    import transformers

    modules, parameters = PEFT_TARGETS[model]
    ranks, alphas = PEFT_PATTERNS.get(model, ({}, {}))
    base = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    torch.manual_seed(seed)
    adapted = peft.get_peft_model(base, peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=modules, target_parameters=parameters, rank_pattern=ranks,
        alpha_pattern=alphas, init_lora_weights=False))
    adapted.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def adapters(hf_models, tmp_path_factory):
    root = tmp_path_factory.mktemp("peft")
    return {model: make_adapter(hf_models[BASE.get(model, model)], str(root / model), model)
            for model in PEFT_TARGETS}


@pytest.fixture(scope="module")
def results(hf_models, megatron_models, adapters, tmp_path_factory):
    """results(layout)[model] from one launch per world size (both at once); the 2-rank launch also
    records the expert-TP refusal."""
    root = tmp_path_factory.mktemp("lora_parity")
    refusals = ["--lora-refusals", json.dumps([megatron_models["qwen3_moe"], adapters["qwen3_moe"]])]
    base = {m: BASE.get(m, m) for m in PEFT_TARGETS}
    for_layout = by_layout("tests/workers/layout_parity.py", LAYOUTS,
                           lambda m: [m, hf_models[base[m]], megatron_models[base[m]], adapters[m]],
                           root, (1, 2), lambda world: refusals if world == 2 else ())
    for_layout.root = root
    return for_layout


@pytest.mark.parametrize("layout,model", CASES)
def test_adapters_match_peft(results, layout, model):
    got = results(layout)[model]
    summary = got["summary"]
    assert summary["max_abs_logprob_diff"] <= 1e-4, summary
    assert summary["loss_rel_diff"] <= 1e-5, summary
    assert summary["max_grad_rel_diff"] <= 1e-4, summary
    assert all(".lora_A." in name or ".lora_B." in name for name in got["grads"])
    base = results("single")[model]
    assert set(got["grads"]) == set(base["grads"])


@pytest.mark.parametrize("layout,model", CASES)
def test_peft_round_trip_is_bit_exact(results, adapters, layout, model):
    """PEFT -> megarl (cut for the layout) -> PEFT: the same tensors, bit for bit, and a config that
    names the same modules and parameters."""
    from safetensors.torch import load_file

    from megarl.models.lora import peft_io

    results(layout)
    saved = os.path.join(results.root, layout, f"{model}.peft")
    ours, theirs = (load_file(os.path.join(d, "adapter_model.safetensors")) for d in (saved, adapters[model]))
    assert set(ours) == set(theirs)
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs)
    with open(os.path.join(saved, "adapter_config.json")) as f, \
            open(os.path.join(adapters[model], "adapter_config.json")) as g:
        mine, peft_config = json.load(f), json.load(g)
    assert (mine["r"], mine["lora_alpha"]) == (peft_config["r"], peft_config["lora_alpha"])
    for field in peft_io.TARGET_FIELDS:  # the user's own: target_modules, rank_pattern, ...
        assert mine[field] == peft_config[field], field


@pytest.mark.parametrize("case", list(SYNC_CASES))
def test_vllm_generates_with_the_adapters_merged_in(case, verified_sync, adapters):
    """After a sync of the perturbed, adapted actor, vLLM's log-probs of its own samples equal the
    adapted actor's: each piece the transport sends is W + scaling * B @ A of its shard."""
    world, adapter, flags = SYNC_CASES[case]
    result = verified_sync(world, BASE.get(adapter, adapter), ["--lora-init", adapters[adapter], *flags])
    assert result["max_abs_logprob_diff"] <= 1e-4, result
    assert result["max_abs_logprob_diff_before_sync"] >= 0.05, result
    assert result["params_synced"] == result["params_expected"] > 0, result


# The adapter-only sync (verify_sync.py --adapters-only): into vLLM's LoRA slots (dense Qwen3 with
# PEFT's default q_proj and v_proj: TP2 into one engine of rollout TP2; up_proj alone: PP2 into two
# engines of rollout TP1), and merged by the engine from its kept base where the slots cannot serve
# them (MoE with expert adapters and ranks mixed in the QKV: EP2 into two engines of rollout TP1;
# every projection: TP2 x EP2 into rollout TP2, whose experts' width is split; DeepSeek-V3's q_a_proj
# without the kv_a_proj_with_mqa vLLM fuses it with, kv_b_proj and the experts into rollout TP2).
ADAPTER_CASES = {
    "tp2_into_rollout_tp2": (2, "qwen3_default", ["--tp", "2", "--rollout-tp", "2"]),
    "pp2_into_two_rollout_tp1": (2, "qwen3_up", ["--pp", "2"]),
    "moe_ep2_merged_into_two_rollout_tp1": (2, "qwen3_moe_ranks", ["--ep", "2"]),
    "moe_tp2_ep2_merged_into_rollout_tp2": (2, "qwen3_moe", ["--tp", "2", "--ep", "2", "--etp", "1",
                                                             "--rollout-tp", "2"]),
    "mla_tp2_ep2_merged_into_rollout_tp2": (2, "deepseek_v3_partial", ["--tp", "2", "--ep", "2", "--etp",
                                                                       "1", "--rollout-tp", "2"]),
}


@pytest.mark.parametrize("case", list(ADAPTER_CASES))
def test_an_adapter_only_sync_sends_the_adapters_alone(case, verified_sync, adapters, hf_models):
    """The first sync writes the base weights; after the adapters move (as training moves them),
    the second sends only them. vLLM serving them (from its LoRA slot, or merged into its weights
    from the kept base) then matches the adapted actor, a third sync of the same adapters changes
    no engine weight (merges do not drift), and every engine rank took in exactly the adapters'
    bytes, as the transport counted them (local + received), which are the PEFT folder's tensors'
    bytes; the planner (resharding/adapter_plan.py, scripts/plan_sync.py --lora) gives each
    rank's counts."""
    from safetensors.torch import load_file

    world, adapter, flags = ADAPTER_CASES[case]
    model = BASE.get(adapter, adapter)
    result = verified_sync(world, model, ["--lora-init", adapters[adapter], "--adapters-only", *flags])
    synced = result["adapter_sync"]
    assert synced["slots"] == (model == "qwen3"), synced
    assert synced["base_written"] == [True, False], synced
    assert synced["repeat_max_abs_change"] == [0.0] * world, synced
    assert result["max_abs_logprob_diff"] <= 1e-4, result
    assert result["max_abs_logprob_diff_before_sync"] >= 0.05, result  # the old adapters' samples
    tensors = load_file(os.path.join(adapters[adapter], "adapter_model.safetensors"))
    assert synced["adapter_bytes"] == sum(t.numel() * t.element_size() for t in tensors.values())
    for local, received in zip(synced["local_bytes"], synced["bytes_received"]):
        assert local + received == synced["adapter_bytes"], synced
    assert sum(synced["bytes_sent"]) == sum(synced["bytes_received"]) > 0, synced
    assert synced["adapter_bytes"] * 20 < result["model_bytes"], synced
    assert all(m == 1 for m in synced["messages"]), synced  # one packed message to the one peer
    # scripts/plan_sync.py --lora's figures at this layout are what the transport counted
    from megarl.models.hf.config import load_arch
    from megarl.models.lora import peft_io
    from megarl.parallel_state.dims import ParallelDims
    from megarl.resharding.adapter_plan import layout_shards, rank_stats

    arch = load_arch(hf_models[model])
    dims = ParallelDims(world_size=world, **{f[2:]: int(v) for f, v in zip(flags[::2], flags[1::2])
                                             if f in ("--tp", "--pp", "--ep", "--etp")})
    config = peft_io.read_config(adapters[adapter], arch)
    planned = rank_stats(layout_shards(arch, dims, config), range(world), [0] * world)
    assert [s.local_bytes for s in planned.values()] == synced["local_bytes"]
    assert [s.recv_intra for s in planned.values()] == synced["bytes_received"]
    assert [s.sent_intra for s in planned.values()] == synced["bytes_sent"]


def test_engines_take_adapters_into_slots_where_vllm_serves_them(hf_models):
    from megarl.models.hf.config import load_arch
    from megarl.models.lora.adapters import LoraConfig
    from megarl.rollout.vllm.lora import AdapterSpec, engine_kwargs, slots_refusal

    qwen3 = load_arch(hf_models["qwen3"])
    assert slots_refusal(qwen3, LoraConfig(rank=4)) is None
    assert "MoE" in slots_refusal(load_arch(hf_models["qwen3_moe"]), LoraConfig(rank=4))
    assert "MoE" in slots_refusal(load_arch(hf_models["deepseek_v3"]), LoraConfig(rank=4))
    assert "max_lora_rank" in slots_refusal(qwen3, LoraConfig(rank=1024))
    # vLLM's max_lora_rank takes a few values: the smallest that holds every kind's rank
    spec = AdapterSpec(qwen3, LoraConfig(rank=4, kind_ranks={"mlp_fc1": 12}))
    assert engine_kwargs(spec)["max_lora_rank"] == 16
    assert engine_kwargs(None) == {}
    # adapters the slots cannot serve are merged by the engine: vLLM's LoRA stays off
    assert engine_kwargs(AdapterSpec(load_arch(hf_models["qwen3_moe"]), LoraConfig(rank=4))) == {}


def test_the_adapters_change_the_model(hf_models, adapters):
    """The parity above is not vacuous: PEFT's model with these adapters differs from the base."""
    from megarl.checks.parity import fixed_tokens, hf_run
    from megarl.models.hf.config import load_arch

    for model in PEFT_TARGETS:
        hf_dir = hf_models[BASE.get(model, model)]
        tokens = fixed_tokens(load_arch(hf_dir).vocab_size, 2, 16)
        with_adapters = hf_run(hf_dir, tokens, False, adapters[model]).logprobs
        base = hf_run(hf_dir, tokens, False).logprobs
        assert (with_adapters - base).abs().max() > 1e-2, model


def test_a_saved_folder_loads_into_peft_as_trained(results, hf_models, adapters):
    """What megarl writes is a PEFT folder PEFT itself loads, to the same model: also where PEFT
    widened the fused gate_up (its rank_pattern and alpha_pattern written back)."""
    from megarl.checks.parity import fixed_tokens, hf_run
    from megarl.models.hf.config import load_arch

    for model, layout in (("qwen3", "tp2"), ("qwen3_moe", "tp2_ep2_etp1"), ("qwen3_moe_widened", "single"),
                          ("qwen3_default", "tp2"), ("qwen3_moe_ranks", "ep2")):
        hf_dir = hf_models[BASE.get(model, model)]
        tokens = fixed_tokens(load_arch(hf_dir).vocab_size, 2, 16)
        results(layout)
        saved = os.path.join(results.root, layout, f"{model}.peft")
        assert torch.equal(hf_run(hf_dir, tokens, False, saved).logprobs,
                           hf_run(hf_dir, tokens, False, adapters[model]).logprobs), model


def test_expert_adapters_refuse_expert_tp(results):
    results("tp2")
    with open(os.path.join(results.root, "refusals.json")) as f:
        refused = json.load(f)
    assert "LoRA on experts needs expert TP 1 (layout.etp=1)" in refused["expert_tp"]


def test_config_refuses_bad_values_by_name():
    from megarl.models.lora.adapters import LoraConfig

    with pytest.raises(ValueError, match="lora.rank=-1"):
        LoraConfig(rank=-1)
    with pytest.raises(ValueError, match=r"lora.targets=\['attention', 'mlp_fc1'\]: \['attention'\]"):
        LoraConfig(rank=4, targets=("attention", "mlp_fc1"))
    with pytest.raises(ValueError, match="lora.dropout=1.5"):
        LoraConfig(rank=4, dropout=1.5)


def test_actor_lora_init_resolves_to_the_folders_adapters(hf_models, adapters, tmp_path):
    """actor.lora.init (the one LoRA key): the run's adapters are the PEFT folder's, its path kept
    (setup loads from it); a rank that disagrees is refused naming both; a folder without PEFT's
    config is refused when the config loads."""
    from megarl.planning.config import RunConfig
    from megarl.planning.resolved import resolve
    from megarl.planning.typed_config import load

    base = [f"model.hf_dir={hf_models['qwen3']}", "data.path=d.jsonl"]
    run = resolve(load(RunConfig, None, [*base, f"actor.lora.init={adapters['qwen3']}"]))
    assert (run.adapters.rank, run.adapters.alpha, run.adapters.init) == (4, 8.0, adapters["qwen3"])
    assert run.engine.adapters is not None  # the engines take the adapters alone
    with pytest.raises(ValueError, match=r"actor.lora \(rank 8, alpha 16.0, rslora False\) differs from "
                                         r"actor.lora.init=.* \(rank 4, alpha 8.0"):
        resolve(load(RunConfig, None, [*base, f"actor.lora.init={adapters['qwen3']}", "actor.lora.rank=8"]))
    with pytest.raises(ValueError, match=r"actor.lora: lora.init='.*' is not a PEFT adapter folder"):
        load(RunConfig, None, [*base, f"actor.lora.init={tmp_path}"])


def test_a_kind_the_family_lacks_is_refused_naming_its_kinds(hf_models):
    from megarl.models.hf.config import load_arch
    from megarl.models.lora.adapters import LoraConfig, chosen_kinds, kinds_of

    qwen3, deepseek = load_arch(hf_models["qwen3"]), load_arch(hf_models["deepseek_v3"])
    assert set(kinds_of(qwen3)) == {"attention_qkv", "attention_proj", "mlp_fc1", "mlp_fc2"}
    assert {"mla_q_down", "mla_q_up", "mla_kv_down", "mla_kv_up", "expert_fc1", "expert_fc2",
            "shared_expert_fc1", "mlp_fc1"} <= set(kinds_of(deepseek))
    assert "attention_qkv" not in kinds_of(deepseek)
    with pytest.raises(ValueError, match=r"lora.targets \['expert_fc1'\]: qwen3 has no such modules"):
        chosen_kinds(qwen3, LoraConfig(rank=4, targets=("expert_fc1",)))


@pytest.mark.parametrize("family", ["gpt_oss", "qwen3_next", "qwen3_5_moe"])
def test_lora_on_the_2026_families_is_refused_naming_the_fix(family, hf_models):
    from megarl.models.hf.config import load_arch
    from megarl.models.lora.adapters import LoraConfig, chosen_kinds

    refusal = rf"not supported yet for the {family} family; set actor.lora.rank=0"
    with pytest.raises(ValueError, match=refusal):
        chosen_kinds(load_arch(hf_models[family]), LoraConfig(rank=4))


def test_expert_slices_follow_peft_s_own_delta():
    """A routed expert's (A, B) cut from PEFT's fused-parameter adapter gives the delta PEFT's
    ParamWrapper computes for that expert, and stacking the slices gives the tensors back."""
    from peft.tuners.lora.layer import ParamWrapper

    from megarl.models.lora.peft_io import _stack_experts, expert_slice

    experts, rank, out, inp = 3, 2, 5, 7
    generator = torch.Generator().manual_seed(0)
    a = torch.randn(experts * rank, inp, generator=generator)
    b = torch.randn(out, rank * experts, generator=generator)

    class Holder:
        num_experts, _did_swap_in_out_features = experts, True
        lora_A = {"x": torch.nn.Linear(inp, experts * rank, bias=False)}
        lora_B = {"x": torch.nn.Linear(experts * rank, out, bias=False)}
        scaling = {"x": 1.0}

        def get_param(self):
            return torch.zeros(experts, out, inp)

    holder = Holder()
    holder.lora_A["x"].weight.data, holder.lora_B["x"].weight.data = a, b
    theirs = ParamWrapper.get_delta_weight(holder, "x")  # [experts, out, in]
    for e in range(experts):
        mine = expert_slice(b, "B", e, experts) @ expert_slice(a, "A", e, experts)
        assert torch.allclose(mine, theirs[e])
    assert torch.equal(_stack_experts({e: expert_slice(a, "A", e, experts) for e in range(experts)}, "A"), a)
    assert torch.equal(_stack_experts({e: expert_slice(b, "B", e, experts) for e in range(experts)}, "B"), b)


def test_transformers_4_expert_adapters_are_refused(hf_models, tmp_path):
    """Per-expert adapters (transformers 4's module layout) are named, with the way to convert."""
    from safetensors.torch import save_file

    from megarl.models.hf.config import load_arch
    from megarl.models.lora.peft_io import read_config

    folder = tmp_path / "old"
    folder.mkdir()
    save_file({"base_model.model.model.layers.0.mlp.experts.3.gate_proj.lora_A.weight": torch.zeros(4, 8)},
              str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 8,
                                                            "target_modules": ["gate_proj"]}))
    with pytest.raises(ValueError, match="adapts one expert .transformers 4's layout."):
        read_config(str(folder), load_arch(hf_models["qwen3_moe"]))


def test_some_projections_of_a_fused_linear_read_as_those_alone(adapters, hf_models):
    """PEFT's default (q_proj, v_proj), up_proj alone and mixed ranks read as those projections of
    the fused linears, each with the rank and alpha PEFT gave it; their scalings are PEFT's."""
    from megarl.models.hf.config import load_arch
    from megarl.models.lora.adapters import chosen_parts
    from megarl.models.lora.peft_io import read_config

    qwen3, moe = load_arch(hf_models["qwen3"]), load_arch(hf_models["qwen3_moe"])
    default = read_config(adapters["qwen3_default"], qwen3)
    assert default.targets == ("attention_qkv.q_proj", "attention_qkv.v_proj") and not default.kind_ranks
    assert chosen_parts(qwen3, default) == {"attention_qkv": ("q_proj", "v_proj")}
    assert chosen_parts(qwen3, read_config(adapters["qwen3_up"], qwen3)) == {"mlp_fc1": ("up_proj",)}
    mixed = read_config(adapters["qwen3_moe_ranks"], moe)
    assert chosen_parts(moe, mixed) == {"attention_qkv": ("q_proj", "v_proj"), "attention_proj": ("o_proj",),
                                        "expert_fc2": ("down_proj",)}
    assert mixed.kind_ranks == {"attention_qkv.v_proj": 2, "attention_proj": 8}
    assert mixed.kind_alphas == {"attention_qkv.v_proj": 2.0}
    # PEFT: alpha / r per module (q 8 / 4, v 2 / 2, o 8 / 8)
    assert [mixed.scaling_of("attention_qkv", "q_proj"), mixed.scaling_of("attention_qkv", "v_proj"),
            mixed.scaling_of("attention_proj", "o_proj")] == [2.0, 1.0, 1.0]


def test_actor_lora_targets_take_hf_projection_names(hf_models):
    """actor.lora.targets names HF projections as PEFT's target_modules do (q_proj: every linear's
    q_proj but the routed experts'), or one kind's (KIND.PROJECTION); a name the model lacks is
    refused naming its projections, one no family has when the config loads. Projections without an
    adapter hold no parameter: the meta model the memory plan counts holds exactly the adapted
    ones."""
    from megarl.models.hf.config import load_arch
    from megarl.models.lora.adapters import LoraConfig, chosen_parts
    from megarl.models.memory.held_params import held_params
    from megarl.parallel_state.dims import ParallelDims

    qwen3, deepseek = load_arch(hf_models["qwen3"]), load_arch(hf_models["deepseek_v3"])
    config = LoraConfig(rank=4, targets=("q_proj", "v_proj"), kind_ranks={"v_proj": 2})
    assert chosen_parts(qwen3, config) == {"attention_qkv": ("q_proj", "v_proj")}
    assert chosen_parts(deepseek, LoraConfig(rank=4, targets=("up_proj",))) == {
        "mlp_fc1": ("up_proj",), "shared_expert_fc1": ("up_proj",)}
    assert chosen_parts(deepseek, LoraConfig(rank=4, targets=("shared_expert_fc1.up_proj", "mla_kv_up"))) == {
        "shared_expert_fc1": ("up_proj",), "mla_kv_up": ("kv_b_proj",)}
    with pytest.raises(ValueError, match=r"lora.targets \['kv_b_proj'\]: qwen3 has no such modules.*"
                                         r"its projections: \['down_proj', 'gate_proj', 'k_proj'"):
        chosen_parts(qwen3, LoraConfig(rank=4, targets=("q_proj", "kv_b_proj")))
    with pytest.raises(ValueError, match=r"lora.targets=\['q_projj'\]: \['q_projj'\]"):
        LoraConfig(rank=4, targets=("q_projj",))
    with pytest.raises(ValueError, match=r"lora.kind_ranks: \['vproj'\]"):
        LoraConfig(rank=4, kind_ranks={"vproj": 2})
    # q: A [4, hidden], B [heads * head_dim, 4]; v: A [2, hidden], B [kv_heads * head_dim, 2]
    h, d = qwen3.hidden_size, qwen3.head_dim
    per_layer = 4 * h + qwen3.num_heads * d * 4 + 2 * h + qwen3.num_kv_heads * d * 2
    held = held_params(qwen3, ParallelDims(world_size=1), lora=config)[0]
    assert held.elements == qwen3.num_layers * per_layer


def test_peft_s_unsupported_features_are_refused_naming_the_field(adapters, hf_models, tmp_path):
    """Before any model is built: DoRA, bias training, modules_to_save, LoHa (not LoRA), some layers
    only, a target_modules entry no module has, a projection adapted in some layers only or with
    ranks that differ between layers."""
    import shutil

    from safetensors.torch import save_file

    from megarl.models.hf.config import load_arch
    from megarl.models.lora.peft_io import read_config

    qwen3 = load_arch(hf_models["qwen3"])
    with open(os.path.join(adapters["qwen3_default"], "adapter_config.json")) as f:
        saved = json.load(f)
    refused = (({"use_dora": True}, "use_dora=True is not supported"),
               ({"bias": "all"}, "bias='all' is not supported"),
               ({"modules_to_save": ["lm_head"]}, r"modules_to_save=\['lm_head'\] is not"),
               ({"peft_type": "LOHA"}, "peft_type='LOHA'; megarl loads LoRA adapters"),
               ({"layers_to_transform": [0]}, r"layers_to_transform=\[0\] is not supported"),
               ({"target_modules": ["q_proj", "v_projj"]},
                r"target_modules entries \['v_projj'\] match no module of this qwen3 model"),
               ({"target_modules": ".*vproj"},
                r"target_modules entries \['.\*vproj'\] match no"))
    for index, (change, message) in enumerate(refused):
        folder = tmp_path / f"{index}_{next(iter(change))}"
        shutil.copytree(adapters["qwen3_default"], folder)
        (folder / "adapter_config.json").write_text(json.dumps({**saved, **change}))
        with pytest.raises(ValueError, match=message):
            read_config(str(folder), qwen3)
    h, q = qwen3.hidden_size, qwen3.num_heads * qwen3.head_dim
    name = "base_model.model.model.layers.{}.self_attn.q_proj.lora_{}.weight"
    module, layers = r"model.layers.{}.self_attn.q_proj", qwen3.num_layers
    for case, ranks, message in (
            ("one_layer", [4], rf"adapts q_proj in 1 of the {layers} modules that have it, not in \['"
                               + module.format(1)),
            ("by_layer", [4, 2] + [4] * (layers - 2), module.format(0) + r" has \(rank, alpha\) \(4, 8.0\) "
                                                       r"but " + module.format(1) + r" \(2, 8.0\)")):
        folder = tmp_path / case
        folder.mkdir()
        save_file({name.format(layer, w): torch.zeros((r, h) if w == "A" else (q, r))
                   for layer, r in enumerate(ranks) for w in "AB"}, str(folder / "adapter_model.safetensors"))
        (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 8,
                                                                "target_modules": ["q_proj"]}))
        with pytest.raises(ValueError, match=message):
            read_config(str(folder), qwen3)


def test_megarl_s_names_select_the_adapted_projections_in_peft(adapters, hf_models, tmp_path):
    """Without the user's folder to copy them from (a run with actor.lora.targets), the PEFT names
    megarl writes select exactly the adapted projections, with their ranks and alphas: PEFT loads
    the folder to the model the user's config gave."""
    from dataclasses import replace

    from safetensors.torch import load_file

    from megarl.checks.parity import fixed_tokens, hf_run
    from megarl.models.hf.config import load_arch
    from megarl.models.lora.adapters import LoraConfig
    from megarl.models.lora.peft_io import WEIGHTS_FILE, peft_targets, read_config, write_folder

    qwen3 = load_arch(hf_models["qwen3"])
    config = LoraConfig(rank=4, targets=("q_proj", "v_proj"), kind_ranks={"v_proj": 2})
    assert peft_targets(qwen3, config) == {"target_modules": ["q_proj", "v_proj"], "target_parameters": None,
                                           "rank_pattern": {"v_proj": 2}, "alpha_pattern": {}}
    for adapter in ("qwen3_moe_ranks", "deepseek_v3_partial", "qwen3_moe_widened"):
        hf_dir = hf_models[BASE[adapter]]
        arch = load_arch(hf_dir)
        config = replace(read_config(adapters[adapter], arch), init=None)
        tensors = load_file(os.path.join(adapters[adapter], WEIGHTS_FILE))
        write_folder(tensors, arch, config, str(tmp_path / adapter))
        tokens = fixed_tokens(arch.vocab_size, 2, 16)
        assert torch.equal(hf_run(hf_dir, tokens, False, str(tmp_path / adapter)).logprobs,
                           hf_run(hf_dir, tokens, False, adapters[adapter]).logprobs), adapter


def test_run_adapter_sizes_are_the_files(adapters, hf_models):
    """The adapter folder's tensors are what PEFT would train: rank 4 per projection, and PEFT's own
    widening of the fused gate_up when gate_proj and up_proj are targets (rank_pattern) is read
    from the tensors."""
    from megarl.models.hf.config import load_arch
    from megarl.models.lora.peft_io import read_config

    config = read_config(adapters["qwen3_moe"], load_arch(hf_models["qwen3_moe"]))
    assert config.rank == 4 and config.alpha == 8 and not config.kind_ranks
    assert set(config.targets) == {"attention_qkv", "attention_proj", "expert_fc1", "expert_fc2"}
    widened = read_config(adapters["qwen3_moe_widened"], load_arch(hf_models["qwen3_moe"]))
    assert (widened.kind_ranks, widened.kind_alphas) == ({"expert_fc1": 8}, {"expert_fc1": 16.0})
    assert widened.scaling_of("expert_fc1") == widened.scaling_of("attention_qkv") == 2.0
