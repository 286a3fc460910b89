"""HF -> Megatron -> HF round trips over random small configs (family, heads, GQA ratio, head
size, vocabulary size, layers, experts and top-k, tied or untied embeddings, and the
DeepSeek-style families' routing groups, dense layers, shared experts, MTP layers stored, absent
or none, MLA and RoPE), one and two ranks (uneven pipeline stages for odd layer counts): the
converter's export and the run's live HF export are bit-exact with the source every time, with
its config.json, and say so when MTP weights were absent. The draw is seeded, so a failure names
a case that reproduces; MEGARL_FUZZ_CASES=N runs seeds 0..N-1 instead, a wider sweep. The converter
scripts' own functions convert every case, one launch per direction and world size
(tests/workers/convert_models.py: a launch costs more here than a tiny conversion;
tests/test_conversion.py runs the scripts)."""

import json
import os
import random

import pytest

from tests.fp8_reference import vllm_dequantized
from tests.launch import finish, load_script, start

FAMILIES = ["llama", "qwen2", "qwen3", "qwen3_moe", "mixtral", "glm4_moe", "deepseek_v3", "gpt_oss",
            "qwen3_next"]
# The CI default: a case per family (seed % 9 picks it), 14 in place of 5 for GLM-4.5: its MTP
# layer declared without weights; 6 stores DeepSeek-V3's; 61 and 107 convert a 3-layer gpt-oss
# (sliding and full layers) and a 3-layer Qwen3-Next (linear and full) at world 2, uneven pipeline
# stages (test_ci_seeds_cover_mtp_states_and_uneven_stages keeps them covering).
CI_SEEDS = [0, 1, 2, 3, 4, 14, 6, 61, 107]
_FUZZ = os.environ.get("MEGARL_FUZZ_CASES")
SEEDS = list(range(int(_FUZZ))) if _FUZZ else CI_SEEDS
# make_tiny_checkpoint's MTP fields for each state a checkpoint's MTP layer can be in.
# (mtp_weights explicit: the deepseek_v3 family's default leaves the weights out)
MTP = {"none": dict(num_nextn_predict_layers=0),
       "stored": dict(num_nextn_predict_layers=1, mtp_weights=True),
       "absent": dict(num_nextn_predict_layers=1, mtp_weights=False)}


def random_config(seed: int):
    rng = random.Random(seed)
    family = FAMILIES[seed % len(FAMILIES)]  # every family in the CI default's cases
    heads = rng.choice([2, 4, 8])
    head_dim = rng.choice([16, 32, 64])
    fields = dict(num_attention_heads=heads, num_key_value_heads=rng.choice([d for d in (1, 2, 4, 8)
                                                                            if heads % d == 0]),
                  head_dim=head_dim, hidden_size=heads * head_dim,  # vLLM's Qwen2 ignores head_dim
                  vocab_size=rng.randint(40, 700), num_hidden_layers=rng.choice([1, 2, 3, 4]),
                  intermediate_size=8 * rng.randint(4, 40),
                  tie_word_embeddings=rng.random() < 0.5)
    if family in ("qwen3_moe", "mixtral"):
        experts = rng.choice([2, 4, 8])
        renormalized = family == "mixtral" or rng.random() < 0.5
        if family == "qwen3_moe":
            fields.update(num_experts=experts, moe_intermediate_size=8 * rng.randint(2, 16),
                          norm_topk_prob=renormalized)
        else:
            fields.update(num_local_experts=experts)
        # Renormalized top-1 is refused (tests/test_hf_config.py).
        fields["num_experts_per_tok"] = rng.randint(2 if renormalized else 1, experts)
    if family in ("glm4_moe", "deepseek_v3"):
        fields.update(deepseek_style(rng, family, fields))
    if family == "qwen3_next":
        fields.update(hybrid(rng, fields))
    if family == "gpt_oss":
        fields.update(gpt_oss_style(rng, fields))
    nproc = 2 if fields["num_hidden_layers"] >= 2 and rng.random() < 0.5 else 1
    # Drawn last, so the earlier draws (and the cases the seeds name) stay as they were.
    if family != "gpt_oss" and rng.random() < 0.4:
        fields["fp8"] = True  # block FP8 as published (make_tiny_checkpoint's _to_fp8)
    return family, fields, nproc


def deepseek_style(rng: random.Random, family: str, fields: dict) -> dict:
    """Routing groups (limited or not), dense first layers, shared experts, an MTP layer stored,
    declared without its weights (as transformers saves it) or none; MLA with or without low-rank
    q and YaRN, or GLM's partial RoPE, QK norm and attention bias."""
    experts = rng.choice([4, 8, 16])
    groups = rng.choice([g for g in (1, 2, 4) if experts // g >= 2])
    group_topk = rng.randint(1, groups)
    # Renormalized top-1 is refused (tests/test_hf_config.py).
    topk = 2 * group_topk if group_topk < groups else rng.randint(2, experts)
    out = dict(n_routed_experts=experts, n_group=groups, topk_group=group_topk,
               num_experts_per_tok=topk, n_shared_experts=rng.randint(1, 2),
               moe_intermediate_size=8 * rng.randint(2, 16), routed_scaling_factor=rng.choice([1.0, 2.5]),
               first_k_dense_replace=rng.randint(0, fields["num_hidden_layers"] - 1),
               **MTP[rng.choice(sorted(MTP))])
    if family == "glm4_moe":
        out.update(partial_rotary_factor=rng.choice([0.5, 1.0]), use_qk_norm=rng.random() < 0.5,
                   attention_bias=rng.random() < 0.5)
        return out
    out.update(num_key_value_heads=fields["num_attention_heads"],
               q_lora_rank=rng.choice([None, 8 * rng.randint(2, 12)]),
               kv_lora_rank=8 * rng.randint(2, 12), qk_rope_head_dim=rng.choice([8, 16, 32]),
               qk_nope_head_dim=rng.choice([16, 32, 64]), v_head_dim=rng.choice([16, 32, 64]),
               topk_method="noaux_tc", scoring_func="sigmoid")
    if rng.random() < 0.5:
        out["rope_scaling"] = dict(type="yarn", factor=rng.choice([2.0, 4.0]),
                                   original_max_position_embeddings=64, mscale=1.0,
                                   mscale_all_dim=rng.choice([0.0, 1.0]))
    return out


def hybrid(rng: random.Random, fields: dict) -> dict:
    """Gated DeltaNet hybrid: any mix of linear and full attention layers, key heads shared by
    one or two value heads, key and value dims apart, the conv's width, the routed experts
    (renormalized or not) beside a gated shared expert, partial RoPE."""
    key_heads = rng.choice([1, 2, 4])
    experts = rng.choice([2, 4, 8])
    renormalized = rng.random() < 0.5
    return dict(layer_types=[rng.choice(["linear_attention", "full_attention"])
                             for _ in range(fields["num_hidden_layers"])],
                linear_num_key_heads=key_heads, linear_num_value_heads=key_heads * rng.choice([1, 2]),
                linear_key_head_dim=rng.choice([16, 32, 64]), linear_value_head_dim=rng.choice([16, 32, 64]),
                linear_conv_kernel_dim=rng.choice([2, 4]), num_experts=experts,
                num_experts_per_tok=rng.randint(2 if renormalized else 1, experts),
                norm_topk_prob=renormalized, moe_intermediate_size=8 * rng.randint(2, 16),
                shared_expert_intermediate_size=8 * rng.randint(2, 16),
                partial_rotary_factor=rng.choice([0.25, 0.5, 1.0]))


def gpt_oss_style(rng: random.Random, fields: dict) -> dict:
    """Fused biased experts and top-k, sliding and full layers in any order and window, YaRN or
    plain RoPE (vLLM's own constants, rms_norm_eps and swiglu_limit, as the family requires)."""
    experts = rng.choice([2, 4, 8])
    out = dict(num_local_experts=experts, num_experts_per_tok=rng.randint(2, experts),
               sliding_window=rng.choice([4, 16]), rms_norm_eps=1e-5, tie_word_embeddings=False,
               layer_types=[rng.choice(["sliding_attention", "full_attention"])
                            for _ in range(fields["num_hidden_layers"])])
    if rng.random() < 0.5:
        out["rope_parameters"] = dict(rope_type="default", rope_theta=150000.0)
    return out


def mtp_state(fields: dict) -> str:
    if not fields.get("num_nextn_predict_layers"):
        return "none"
    return "stored" if fields.get("mtp_weights", True) else "absent"


def _partial_blocks(fields: dict) -> bool:
    """Whether a dim of the case's weights ends in a partial 128-wide block after a whole one."""
    dims = [fields[k] for k in ("hidden_size", "intermediate_size", "moe_intermediate_size") if fields.get(k)]
    return any(d > 128 and d % 128 for d in dims)


def test_ci_seeds_cover_mtp_states_and_uneven_stages():
    """The CI default's cases store an MTP layer, declare one without weights, convert an odd
    layer count at world 2 (uneven pipeline stages), and read block-FP8 checkpoints, one with
    partial edge blocks; a change to the draw that loses one fails."""
    drawn = [random_config(seed) for seed in CI_SEEDS]
    assert {mtp_state(fields) for _, fields, _ in drawn} >= {"stored", "absent"}
    assert any(fields.get("fp8") and _partial_blocks(fields) for _, fields, _ in drawn)
    assert any(fields["num_hidden_layers"] % 2 for _, fields, _ in drawn
               if fields["num_hidden_layers"] >= 2)


@pytest.fixture(scope="module")
def round_trips(tmp_path_factory):
    """{seed: (family, fields, HF dir, {export: (its HF dir, its notes)})}, the exports being the
    converter's Megatron -> HF ("converted") and the run's live HF export ("live"), and the notes
    of HF -> Megatron ("imported"). Converted to Megatron at the case's world size, back at the
    other one where there are layers for two stages."""
    from megarl.demo.tiny_checkpoint import make_tiny_checkpoint

    root = tmp_path_factory.mktemp("fuzz")
    cases, there, back = {}, {1: [], 2: []}, {1: [], 2: []}
    for seed in SEEDS:
        family, fields, nproc = random_config(seed)
        hf = make_tiny_checkpoint(family, str(root / f"{seed}_hf"), seed=seed, **fields)
        megatron = str(root / f"{seed}_megatron")
        exports = {name: str(root / f"{seed}_{name}") for name in ("converted", "live")}
        there[nproc].append(["hf_to_megatron", hf, megatron])
        world_back = 3 - nproc if fields["num_hidden_layers"] >= 2 else 1
        back[world_back] += [["megatron_to_hf", megatron, exports["converted"]],
                             ["export_hf", megatron, hf, exports["live"]]]
        cases[seed] = (family, fields, hf, {"imported": megatron, **exports})
    notes = {}
    for jobs in (there, back):  # each direction's launches at once (one has one rank)
        for proc in finish(*(start("tests/workers/convert_models.py", "--jobs", json.dumps(work), nproc=nproc,
                                   timeout=900) for nproc, work in jobs.items() if work)):
            done = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith('{"done"')]
            notes.update({d["done"]: d["notes"] for d in done})
    return {seed: (family, fields, hf, {name: (out, notes[out]) for name, out in outs.items()})
            for seed, (family, fields, hf, outs) in cases.items()}


@pytest.mark.parametrize("seed", SEEDS)
def test_random_config_round_trip_is_bit_exact(seed, round_trips):
    family, fields, hf, outs = round_trips[seed]
    # An FP8 checkpoint comes back unquantized: bit-exact with vLLM's dequantization of it
    source = vllm_dequantized(hf, hf + ".dequantized") if fields.get("fp8") else hf
    for name in ("converted", "live"):
        back = outs[name][0]
        # scripts/compare_hf_checkpoints.py's comparison, in this process (its launch: a fifth of a case)
        result = load_script("compare_hf_checkpoints").compare(source, back)
        assert result["bit_exact"], (name, family, fields, result)
        with open(os.path.join(source, "config.json")) as a, open(os.path.join(back, "config.json")) as b:
            assert json.load(a) == json.load(b), (name, family, fields)
    for name, (_, notes) in outs.items():
        said = any("MTP weights absent" in note and "num_nextn_predict_layers=1" in note for note in notes)
        assert said == (mtp_state(fields) == "absent"), (name, family, fields, notes)
