"""Rollout routing replay (R3) end to end: a bf16 MoE trained at EP2, synced into vLLM at rollout
TP2, the engine returning each token's experts (megarl/rollout/vllm/routing.py), the actor
scoring the samples with router replay off and rollout (scripts/verify_sync.py --routing). Both
sides route in fp32 (model.router_fp32's default): the engine's gates too, though vLLM builds
Qwen3-MoE's in the model's dtype (megarl/rollout/vllm/fp32_router.py).

With R3 the actor routes every token through the engine's experts: the fraction of (token,
layer) pairs routed differently is exactly 0, and the largest log-prob difference is no larger
than without it. Without replay the engine's routing, aligned to the trainer's tokens, mostly
agrees with the trainer's own (a shift of one column would make nearly every pair differ).
"""

import json

import pytest

from tests.launch import last_json, run


# gpt-oss: its biased router (vLLM's mlp.router, a GateLinear built in fp32 too) and sliding
# windows; measured: without replay 3.6% of (token, layer) pairs routed differently and 0.71 the
# largest log-prob gap, with R3 0 and 0.076.
@pytest.mark.parametrize("model", ["qwen3_moe", "gpt_oss"])
def test_r3_routes_as_the_engine_did_and_narrows_the_gap(hf_models, capsys, model):
    proc = run("scripts/verify_sync.py", "--hf-dir", hf_models[model], "--ep", "2",
               "--rollout-tp", "2", "--dtype", "bfloat16", "--routing", "--prompts", "8",
               "--max-new-tokens", "16", "--max-logprob-diff", "1", nproc=2, timeout=900)
    result = last_json(proc)
    # the bf16 engine's fp32 tensors (its gates; gpt-oss's router bias) are those the planners count in fp32
    assert result["engine_fp32_mismatches"] == [[], []], result
    report = result["routing"]
    with capsys.disabled():  # on the terminal: the figures docs/PERFORMANCE.md quotes
        print(f"\nR3 at bf16, EP2 into rollout TP2 ({model}): {json.dumps(report)}")
    assert report["engine_gate_dtypes"] == ["torch.float32"], report
    off, r3 = report["off"], report["rollout"]
    assert r3["routing/topk_diff_fraction"] == 0.0 and r3["routing/tokens_diff_fraction"] == 0.0
    assert r3["max_abs_logprob_diff"] <= off["max_abs_logprob_diff"], report
    assert off["routing/topk_diff_fraction"] < 0.2, report
