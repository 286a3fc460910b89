"""source_layout.layout_pieces against live Megatron models over gloo: at each layout, every
rank's metadata.local_pieces (what a weight sync gathers) of the policy and of the value model
equal the pieces computed without a model, rank by rank, shape by shape. One torchrun launch
per world size rebuilds the groups for each of its layouts (tests/workers/source_layout_check.py).
The pure properties are in tests/test_source_layout.py."""

import functools
import json

import pytest

from tests.launch import last_json, run

MOE = ["qwen3_moe", "mixtral"]
# world size -> {layout name: (ParallelDims fields, models)}; the tiny models have 4 layers,
# 4 query and 2 KV heads (qwen2_gqa1: 1), 8 experts of width 64.
WORLDS = {
    2: {
        "tp2": ({"tp": 2}, ["qwen3", "qwen2", "llama_tied", "qwen3_moe"]),
        "ep2": ({"ep": 2}, MOE),
        # the hybrids: in_proj and conv1d sharded by parts, A_log/dt_bias by heads, gated attention
        # gpt-oss: sinks split over TP by heads, biases of attention, router and experts
        "tp2_ep2_etp1": ({"tp": 2, "ep": 2, "etp": 1}, ["qwen3_moe", "deepseek_v3", "glm4_moe", "gpt_oss",
                                                         "qwen3_next", "qwen3_5_moe"]),
        "pp2_vpp2": ({"pp": 2, "vpp": 2}, ["llama_tied", "qwen3_moe"]),
        "cp2": ({"cp": 2}, ["qwen3"]),
        # MLA, the expert bias (fp32), shared experts, a dense first layer on stage 0
        "pp2": ({"pp": 2}, ["llama_tied", "qwen3_moe", "qwen2_gqa1", "deepseek_v3", "glm4_moe"]),
        "pp2_last1": ({"pp": 2, "last_stage_layers": 1}, ["deepseek_v3"]),
    },
    4: {
        "tp2_pp2": ({"tp": 2, "pp": 2}, ["qwen3", "llama_tied", "qwen2"]),
        "tp2_ep2_etp1": ({"tp": 2, "ep": 2, "etp": 1}, ["qwen3_moe"]),
        "pp2_vpp2": ({"pp": 2, "vpp": 2}, ["llama_tied", "qwen3_moe"]),
        "tp2_pp2_vpp2": ({"tp": 2, "pp": 2, "vpp": 2}, ["qwen3_moe"]),
        "pp4": ({"pp": 4}, ["llama_tied"]),
        "pp4_uneven": ({"pp": 4, "first_stage_layers": 1, "last_stage_layers": 1}, ["qwen3"]),
        "tp2_ep2": ({"tp": 2, "ep": 2}, ["mixtral"]),
        "ep4": ({"ep": 4}, ["qwen3_moe"]),
        "ep2_etp2": ({"ep": 2, "etp": 2}, ["qwen3_moe"]),  # expert TP without dense TP
        "pp2_ep2": ({"pp": 2, "ep": 2}, ["qwen3_moe"]),
        "cp2_ep2": ({"cp": 2, "ep": 2}, ["mixtral"]),
    },
}
ROLES = ("policy", "value")
CASES = [(world, layout, model, role) for world, layouts in WORLDS.items()
         for layout, (_, models) in layouts.items() for model in models for role in ROLES]


@pytest.fixture(scope="module")
def results(hf_models):
    @functools.lru_cache(maxsize=None)
    def for_world(world):
        layouts = [[name, fields, models] for name, (fields, models) in WORLDS[world].items()]
        needed = {m for _, _, models in layouts for m in models}
        proc = run("tests/workers/source_layout_check.py", "--layouts", json.dumps(layouts),
                   "--models", json.dumps({m: hf_models[m] for m in needed}), nproc=world,
                   timeout=600)
        out = last_json(proc)
        assert out["world"] == world
        return {(r["layout"], r["model"], r["role"]): r for r in out["results"]}

    return for_world


@pytest.mark.parametrize("world,layout,model,role", CASES)
def test_layout_pieces_equal_the_live_models(results, world, layout, model, role):
    got = results(world)[(layout, model, role)]
    assert got["live"] > 0 and got["distinct_live"] == got["live"], got
    assert got["equal"], got
    assert got["pure"] == got["live"], got
