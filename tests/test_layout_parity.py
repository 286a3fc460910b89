"""Every family at every layout against HF transformers and against the single-rank layout:
log-probs (<= 1e-4 abs), loss and full-parameter gradients (<= 1e-5 relative, max-abs-diff
over max-abs). Each world size is one torchrun launch that checks all of its layouts' models."""

import pytest

from tests.conftest import DEEPSEEK_MODELS, HYBRID_MODELS, MODELS, MOE_MODELS, selected_params
from tests.launch import by_layout, run

# One KV head cannot be split over tp=2; gpt-oss's biased experts need etp=1 (its tp2_etp1 case).
TP_OK = [m for m in MODELS if m not in ("qwen2_gqa1", "gpt_oss")]
# The DeepSeek-style families at the layouts their issue names (all 2-rank, so cheap); context
# parallelism and the 4-rank layouts stay with the other families.
# The hybrids likewise (their linear attention refuses CP), and gpt-oss (sinks, sliding windows on
# sequences longer than its 16-token window, biased experts) at the 2-rank layouts issue 50 names.
OTHERS = [m for m in MODELS if m not in DEEPSEEK_MODELS + HYBRID_MODELS + ["gpt_oss"]]
LAYOUTS = {
    # name: (world size, ParallelDims fields, models)
    "single": (1, {}, MODELS),
    "tp2": (2, {"tp": 2}, TP_OK),
    "pp2": (2, {"pp": 2}, MODELS),
    "cp2": (2, {"cp": 2}, OTHERS),
    "ep2": (2, {"ep": 2}, MOE_MODELS),
    "tp2_ep2_etp1": (2, {"tp": 2, "ep": 2, "etp": 1}, MOE_MODELS),
    # experts whole on both TP ranks, each running its share of the tokens: their gradients summed
    # over the expert-data-parallel group (builder.mark_expert_params; Megatron alone did not at ep=1)
    "tp2_etp1": (2, {"tp": 2, "etp": 1}, ["qwen3_moe", "gpt_oss"]),
    "pp2_vpp2": (2, {"pp": 2, "vpp": 2}, ["llama_tied", "qwen3_moe", *DEEPSEEK_MODELS]),
    # uneven stages (DeepSeek-V3's 61 layers split no other way): the dense layer alone first
    "pp2_first1": (2, {"pp": 2, "first_stage_layers": 1}, DEEPSEEK_MODELS),
    "tp2_pp2": (4, {"tp": 2, "pp": 2}, [m for m in TP_OK if m in OTHERS]),
    "tp2_ep2": (4, {"tp": 2, "ep": 2}, [m for m in MOE_MODELS if m in OTHERS]),
}
CASES = [(layout, model) for layout, (_, _, models) in LAYOUTS.items() for model in models]


@pytest.fixture(scope="module")
def results(request, hf_models, megatron_models, tmp_path_factory):
    """results(layout)[model], from one launch per world size the selected cases need (1 always:
    every case compares with it): starting a launch takes longer here than checking a layout's
    models. The launches run at once (the one-rank launch would leave a core idle); a failed one
    fails only its own layouts' cases."""
    worlds = {1} | {LAYOUTS[layout][0] for layout in selected_params(request, "layout")}
    root = tmp_path_factory.mktemp("parity")
    return by_layout("tests/workers/layout_parity.py", LAYOUTS,
                     lambda m: [m, hf_models[m], megatron_models[m]], root, worlds)


def _rel(a, b):
    return float((a.double() - b.double()).abs().max() / b.double().abs().max())


@pytest.mark.parametrize("layout,model", CASES)
def test_matches_hf_and_single_rank(results, layout, model):
    got = results(layout)[model]
    summary = got["summary"]
    assert summary["max_abs_logprob_diff"] <= 1e-4, summary
    assert summary["loss_rel_diff"] <= 1e-5, summary
    assert summary["max_grad_rel_diff"] <= 5e-5, summary  # independent implementation (HF)
    base = results("single")[model]
    assert abs(got["loss"] - base["loss"]) / abs(base["loss"]) <= 1e-5
    assert set(got["grads"]) == set(base["grads"])
    worst = max(got["grads"], key=lambda n: _rel(got["grads"][n], base["grads"][n]))
    assert _rel(got["grads"][worst], base["grads"][worst]) <= 1e-5, worst


def test_parity_check_detects_a_wrong_layout_mapping(hf_models, megatron_models):
    """The comparison is not vacuous: a checkpoint of a different model fails it."""
    proc = run("scripts/verify_conversion.py", "--hf-dir", hf_models["llama"],
               "--megatron-dir", megatron_models["llama_tied"], check=False)
    assert proc.returncode != 0
    assert "exceeds --max-logprob-diff" in proc.stderr
