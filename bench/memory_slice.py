"""Worker of scripts/gpu_check.py: the memory plan (planning/memory_plan.py, what
scripts/plan_memory.py and the preflight use) against the measured peak of each phase of a real
actor step, on a few-layer slice of a published model, at world 1.

  python bench/memory_slice.py --model qwen3-30b-a3b|deepseek-v3 --widths real|tiny \
      [--vocab V] [--batch SEQUENCES,LENGTH,MICRO_BATCH_TOKENS]
  python bench/memory_slice.py --replay docs/gpu/h200_2026-11-28.json   # no run: today's plan
                                                                        # against a GPU's record

The slice: docs/configs/<model>.json with fewer layers (DeepSeek-V3: one dense layer, then MoE
layers; 16 of its 256 routed experts, the share of an EP16 rank, since its 11 B parameters per MoE
layer do not fit one GPU with their Adam state; no MTP layer). `real`: the published widths,
vocabulary and bf16, for a GPU. `tiny`: the tiny test model's widths (megarl/demo/tiny_checkpoint.py)
with a 32K vocabulary in fp32, the CPU counterpart (bench/bench_memory.py's phase check: state and
logits that dwarf what the process holds besides them). Measured: bench/memory_phases.py's
measure() (the second of two steps; GPU: the allocator's peak, torch.cuda.max_memory_allocated
after reset_peak_memory_stats; CPU: the resident set's high-water mark), each phase's peak above
the memory in use before the model was built. The plan is of what the worker builds here: the
layer spec this process takes (device_choice.uses_transformer_engine; the GPU check runs the
portable one) and the Adam Megatron builds here (optimizer.built_adam: without Transformer Engine
or Apex torch's AdamW, multi-tensor on CUDA), both named in the output, with the planned update's
parts: the state, the backward's transients and the optimizer step's (the update peaks at the state
plus the larger of the two). Prints one JSON object. --vocab and --batch change the slice (a step
that outweighs the backward: --widths tiny --vocab 262144 --batch 2,64,128). --plan-only DEVICE plans
the slice as the GPU check runs it there and runs nothing; --replay FILE plans the slices of a GPU's
record (megarl/planning/memory_record.py) instead.
"""

import argparse
import json
import os
from typing import Tuple

import torch
from memory_phases import full_batch, measure  # bench/ is the script's directory

from megarl.actor.optimizer import built_adam
from megarl.demo.tiny_checkpoint import BASE, FAMILIES
from megarl.models.hf.config import arch_from_hf_config
from megarl.models.weights.destination import RolloutLayout
from megarl.parallel_state import megatron_groups
from megarl.parallel_state.dims import ParallelDims
from megarl.planning import memory_plan as mp
from megarl.planning import memory_record
from megarl.platform import device_choice

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# |planned - measured| <= this share of measured, every phase: on a GPU issue 48's bar (the
# allocator's own peak); on a CPU the resident set also counts glibc's free lists (bench_memory.py's
# PHASE_BOUND)
BOUND = {"cuda": 0.10, "cpu": 0.15}
PHASES = ("old_logprobs", "actor_update")
# name -> (tiny family, slice fields, {widths: (sequences, length, micro-batch tokens)}). Real
# widths: micro-batches of 8K / 4K tokens, two per step; updates planned at 66.4 GB and 89.2 GB on
# CUDA without Transformer Engine (H200: 150 GB).
SLICES = {
    "qwen3-30b-a3b": ("qwen3_moe", dict(num_hidden_layers=4),
                      {"real": (4, 4096, 8192), "tiny": (4, 256, 512)}),
    "deepseek-v3": ("deepseek_v3", dict(num_hidden_layers=3, first_k_dense_replace=1, n_routed_experts=16,
                                        num_nextn_predict_layers=0),
                    {"real": (4, 2048, 4096), "tiny": (4, 256, 512)}),
}
TINY = dict(vocab_size=32000, torch_dtype="float32")
NOT_WIDTHS = ("architectures", "model_type", "mtp_weights", "num_hidden_layers", "first_k_dense_replace",
              "n_routed_experts", "num_nextn_predict_layers")


def slice_config(model: str, widths: str) -> dict:
    """The slice's HF config.json."""
    family, fields, _ = SLICES[model]
    with open(os.path.join(ROOT, "docs", "configs", f"{model}.json")) as f:
        config = json.load(f)
    if widths == "tiny":
        config.update({k: v for k, v in {**BASE, **FAMILIES[family]}.items() if k not in NOT_WIDTHS}, **TINY)
    return {**config, **fields}


def ran_here() -> dict:
    """What the worker builds in this process: the device, the layer spec and Megatron's Adam."""
    on_gpu, use_te, adam = device_choice.on_gpu(), device_choice.uses_transformer_engine(), built_adam()
    kind = {"te": "Transformer Engine's FusedAdam", "apex": "Apex's FusedAdam",
            "torch": f"torch's AdamW, {'multi-tensor' if on_gpu else 'per tensor'}"}[adam]
    return {"device": "cuda" if on_gpu else "cpu", "transformer_engine": use_te, "adam": adam,
            "optimizer": kind, "layer_spec": "Transformer Engine's" if use_te else "portable"}


def planned(arch, dims: ParallelDims, budget: int, ran: dict) -> Tuple[dict, dict]:
    """The plan's peaks of the phases measured, for what the worker runs (`ran`): the actor alone,
    no engine (colocated=False), nothing else on the rank; and the update's parts (bytes): the
    state it holds, its backward's transients and its optimizer step's (the larger of the two is
    its peak over the state)."""
    request = mp.MemoryRequest(arch=arch, dims=dims, rollout=RolloutLayout(1), device_bytes=float("inf"),
                               actor=mp.TrainedModel(budget), gpu=ran["device"] == "cuda",
                               transformer_engine=ran["transformer_engine"], adam=ran["adam"],
                               colocated=False)
    stage = mp.plan_memory(request)[0]
    t = stage.terms
    parts = {"state": t["actor_params"] + t["actor_grads"] + t["actor_optimizer"],
             "backward": t["actor_activations"] + t["actor_logits"] + t["actor_logprob_train"],
             "step": t["actor_step"]}
    return {phase: stage.phases[phase] for phase in PHASES}, parts


def replay(path: str) -> dict:
    """Today's plan of a GPU record's slices against its measured phases, like for like."""
    record = memory_record.load(path)
    slices = memory_record.replay(record)
    return {"record": path, "commit": record["commit"], "ran": record["ran"], "slices": slices,
            "worst_error": max(abs(p["error"]) for phases in slices.values() for p in phases.values())}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--model", choices=sorted(SLICES))
    parser.add_argument("--widths", choices=("real", "tiny"))
    parser.add_argument("--replay", metavar="FILE", help="a GPU's record (docs/gpu/): plan, run nothing")
    parser.add_argument("--plan-only", choices=("cuda", "cpu"),
                        help="plan, run nothing: as the GPU check runs the slice on that device without "
                        "Transformer Engine or Apex (the portable attention, torch's AdamW)")
    parser.add_argument("--vocab", type=int, help="another vocabulary size (the slice's by default)")
    parser.add_argument("--batch", metavar="SEQUENCES,LENGTH,MICRO_BATCH_TOKENS",
                        help="another batch (the slice's by default)")
    args = parser.parse_args()
    if args.replay:
        print(json.dumps(replay(args.replay)), flush=True)
        return
    if not (args.model and args.widths):
        parser.error("--model and --widths are required (or --replay FILE)")
    if not device_choice.on_gpu():
        torch.set_num_threads(1)  # a 2-core machine
    config = slice_config(args.model, args.widths)
    if args.vocab:
        config["vocab_size"] = args.vocab
    arch = arch_from_hf_config(config)
    sequences, length, budget = SLICES[args.model][2][args.widths]
    if args.batch:
        sequences, length, budget = (int(n) for n in args.batch.split(","))
    dims = ParallelDims(world_size=1)
    ran = ran_here() if not args.plan_only else \
        {"device": args.plan_only, "transformer_engine": False, "adam": "torch", "layer_spec": "portable",
         "optimizer": f"torch's AdamW, {'multi-tensor' if args.plan_only == 'cuda' else 'per tensor'}"}
    plan, parts = planned(arch, dims, budget, ran)  # before any process group: the plan builds on meta
    if args.plan_only:
        print(json.dumps({"model": args.model, "widths": args.widths, "ran": ran, "sequences": sequences,
                          "length": length, "micro_batch_tokens": budget,
                          "planned_gb": {p: round(v / 1e9, 3) for p, v in plan.items()},
                          "planned_update_parts_gb": {k: round(v / 1e9, 3) for k, v in parts.items()}}))
        return
    measured = measure(arch, dims, full_batch(arch.vocab_size, sequences, length), budget)
    megatron_groups.destroy()
    phases = {phase: {"planned_gb": round(plan[phase] / 1e9, 3),
                      "measured_gb": round(measured[phase] / 1e9, 3),
                      "error": round((plan[phase] - measured[phase]) / measured[phase], 4)}
              for phase in PHASES}
    worst = max(abs(p["error"]) for p in phases.values())
    bound = BOUND["cuda" if device_choice.on_gpu() else "cpu"]
    print(json.dumps({
        "model": args.model, "widths": args.widths, "dtype": arch.dtype, "layers": arch.num_layers,
        "hidden": arch.hidden_size, "experts": arch.num_experts, "vocab": arch.vocab_size,
        "sequences": sequences, "length": length, "micro_batch_tokens": budget,
        "measured_by": "torch.cuda.max_memory_allocated" if device_choice.on_gpu()
        else "VmHWM (the resident set)", "ran": ran,
        "planned_update_parts_gb": {k: round(v / 1e9, 3) for k, v in parts.items()},
        "phases": phases, "worst_error": worst, "bound": bound, "within_bound": worst <= bound}), flush=True)


if __name__ == "__main__":
    main()
