"""Today's memory plan against a GPU's recorded measurement of bench/memory_slice.py's slices
(docs/gpu/<gpu>_<date>.json): each slice planned with the layer spec and the Adam that ran there,
and the terms megarl has changed since that run (the record's `then`: the log-prob head, the
finite check before the optimizer step, the experts' optimizer at ep=1) put back as they were, so
that everything else in the plan is checked against the GPU like for like.

Owns reading such a record and that comparison; tests/test_memory_plan.py holds the plan to it,
tests/test_presets.py takes the presets' margin from it, bench/memory_slice.py --replay prints it.
Does not own the plan (planning/memory_plan.py) or the measurement (bench/memory_slice.py).
"""

import json
import os
from dataclasses import replace
from typing import Dict

from megarl.models.hf.config import DTYPES, arch_from_hf_config
from megarl.models.megatron.config import padded_vocab_size
from megarl.models.weights.destination import RolloutLayout
from megarl.parallel_state.dims import ParallelDims
from megarl.planning import memory_plan as mp

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
H200 = os.path.join(ROOT, "docs", "gpu", "h200_2026-11-28.json")
FP32 = 4


def load(path: str = H200) -> dict:
    with open(path) as f:
        record = json.load(f)
    missing = [key for key in ("commit", "ran", "then", "slices") if key not in record]
    if missing:
        raise ValueError(f"{path}: no {missing} (a record of bench/memory_slice.py's slices: what ran, "
                         "the terms as they were then, and each slice's measured phases)")
    return record


def then_head_bytes(head: dict, tokens: int, vocab_shard: int, logits_bytes: int, backward: bool) -> int:
    """Pure: the log-prob head's bytes beyond the logits as the record's `then.logprob_head` says it
    held them: fp32 [chunk, V/tp] temporaries, and in the backward the logits' gradient."""
    chunk = min(head["chunk_tokens"], tokens) * vocab_shard * FP32
    if not backward:
        return head["forward_fp32_chunks"] * chunk
    return head["backward_fp32_chunks"] * chunk + tokens * vocab_shard * logits_bytes


def slice_request(record: dict, name: str) -> mp.MemoryRequest:
    """The plan's request for one recorded slice: the actor alone at world 1 (no engine, nothing
    else on the GPU), with the layer spec and the Adam that ran."""
    piece, ran = record["slices"][name], record["ran"]
    with open(os.path.join(ROOT, piece["hf_config"])) as f:
        config = {**json.load(f), **piece["config_changes"]}
    arch = arch_from_hf_config(config)
    return mp.MemoryRequest(arch=arch, dims=ParallelDims(world_size=1), rollout=RolloutLayout(1),
                            device_bytes=float("inf"), actor=mp.TrainedModel(piece["micro_batch_tokens"]),
                            gpu=ran["device"] == "cuda", transformer_engine=ran["transformer_engine"],
                            adam=ran["adam"], colocated=False)


def replayed_peaks(record: dict, name: str) -> Dict[str, float]:
    """Today's planned peaks (bytes) of one slice's measured phases, the record's `then` terms in
    place of today's."""
    request = slice_request(record, name)
    (stage,) = mp.plan_memory(request)
    then, arch, tokens = record["then"], request.arch, request.actor.micro_batch_tokens
    terms, held = dict(stage.terms), stage.held["actor"]
    logits_bytes = DTYPES[arch.dtype].itemsize
    shard = padded_vocab_size(arch.vocab_size, 1)
    for phase, backward in (("logprob_forward", False), ("logprob_train", True)):
        terms[f"actor_{phase}"] = then_head_bytes(then["logprob_head"], tokens, shard, logits_bytes, backward)
    if then.get("experts_with_dense_at_ep1") and request.dims.ep == 1:
        # One DDP buffer and one optimizer held experts and dense parameters alike then.
        held = replace(held, dense=held.elements, expert=0)
        terms["actor_step"] = mp.state_bytes(held, request.actor, request)["step"]
    # The finite check ran over each DDP gradient buffer (dense parameters' and experts') in turn.
    finite = then["finite_check_bytes_per_gradient_element"] * max(held.dense, held.expert)
    terms["actor_step"] = max(terms["actor_step"], finite)
    phases = mp.phase_peaks(request, terms)
    return {phase: phases[phase] for phase in record["slices"][name]["phases"]}


def replay(record: dict) -> Dict[str, Dict[str, dict]]:
    """{slice: {phase: planned_gb, measured_gb, error}}: today's plan (like for like) against the
    record; error = (planned - measured) / measured."""
    out = {}
    for name, piece in record["slices"].items():
        peaks = replayed_peaks(record, name)
        out[name] = {}
        for phase, figures in piece["phases"].items():
            measured = figures["measured_gb"]
            out[name][phase] = {"planned_gb": round(peaks[phase] / mp.GB, 3), "measured_gb": measured,
                                "error": round((peaks[phase] / mp.GB - measured) / measured, 4)}
    return out


def worst_error(record: dict) -> float:
    """The plan's worst |error| against the record: the margin a preset needs beyond its headroom."""
    return max(abs(p["error"]) for phases in replay(record).values() for p in phases.values())
