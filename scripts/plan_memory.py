"""Will a run fit in GPU memory? Plan every phase of a colocated step per GPU, before launch.

  python scripts/plan_memory.py --hf-config docs/configs/qwen3-30b-a3b.json \\
      --train tp=4,pp=2,ep=8,etp=1 --rollout tp=4 --nodes 4 --gpus-per-node 8 --gpu-memory-gb 80 \\
      --micro-batch-tokens 16384 --recompute full --optimizer-offload 0
  python scripts/plan_memory.py --config configs/qwen3_30b_a3b_gpu.yaml \\
      --hf-config docs/configs/qwen3-30b-a3b.json     # a run's own config, as its preflight plans it

Builds the model of each pipeline stage on the meta device (Megatron-Core's layers, no weights:
seconds) and composes each phase of a step from what the run's own code holds
(megarl/planning/memory_plan.py names the source of every term): engine start, weight sync,
generation (vLLM's share of the GPU), old/ref log-probs, a distillation teacher's log-probs
(--teacher-hf-config, or a --config run's teacher: section), critic values, actor and critic
updates, HF export. Prints each phase's peak per pipeline stage and the binding stage's terms, then the
verdict; the last line is one JSON object with fits, peak_gb_per_gpu, phase_peaks_gb, headroom_gb
and binding_phase.

--recompute: none | selective[:MODULE+MODULE] | full[:uniform|block[:N]] (full alone: uniform, 1
layer). --reserve-gb: memory that is not PyTorch's tensors (CUDA context, NCCL buffers, vLLM's
CUDA graphs, the allocator's fragmentation), assumed, not measured. The layer spec and the Adam
planned: --transformer-engine and --adam; with --config, what the run's preflight plans (on a GPU
what this machine builds, elsewhere the config's model.transformer_engine: auto and true plan
Transformer Engine's attention and FusedAdam, false the portable attention and torch's AdamW).
"""

import argparse
import json
import os
import sys

from megarl.actor.optimizer import ADAM_KINDS, OptimizerOffloadConfig
from megarl.models.megatron.config import RECOMPUTE_MODULES, RecomputeConfig
from megarl.planning import memory_plan as mp
from megarl.resharding import cluster_plan as cp

ADAM_NAMES = {"te": "Transformer Engine's FusedAdam", "apex": "Apex's FusedAdam", "torch": "torch's AdamW"}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--hf-config", required=True, help="an HF config.json, or its directory")
    parser.add_argument("--config", help="a run's YAML (configs/): plan it as its preflight does; the "
                        "layout flags below are then taken from it")
    parser.add_argument("--train", help="training layout: tp=,pp=,cp=,ep=,etp=,vpp= (dp derived)")
    parser.add_argument("--rollout", default="tp=1", help="engine layout: tp=[,ep=]")
    parser.add_argument("--nodes", type=int, default=1)
    parser.add_argument("--gpus-per-node", type=int, default=8)
    parser.add_argument("--gpu-memory-gb", type=float, default=80.0, help="per GPU (H100: 80)")
    parser.add_argument("--micro-batch-tokens", type=int, default=8192,
                        help="the packing budget per micro-batch and DP rank (actor.batching)")
    parser.add_argument("--recompute", default="none", help="activation recompute (see above)")
    parser.add_argument("--optimizer-offload", type=float, default=0.0,
                        help="share of Adam's state kept and stepped on the host (0..1)")
    parser.add_argument("--engine-fraction", type=float, default=0.5,
                        help="vLLM's gpu_memory_utilization (generation.gpu_memory_utilization)")
    parser.add_argument("--rollout-quantization", choices=("none", "fp8"), default="none",
                        help="fp8: block-FP8 engine weights (rollout.quantization)")
    parser.add_argument("--no-router-fp32", action="store_true",
                        help="MoE gates in the model's dtype in the engine (default fp32: model.router_fp32)")
    parser.add_argument("--critic", action="store_true", help="a critic of the same shape (PPO with GAE)")
    parser.add_argument("--offload-params", action="store_true",
                        help="training parameters off the GPU while vLLM generates")
    parser.add_argument("--no-export", action="store_true", help="no HF export at the end")
    parser.add_argument("--bucket-mb", type=int, default=256, help="layout.sync_bucket_mb")
    parser.add_argument("--dtype", default=None, help="the model's dtype (default: the config's)")
    parser.add_argument("--transformer-engine", choices=("true", "false"), default="true",
                        help="the layer spec: Transformer Engine's (flash attention: K and V per KV "
                        "head) or the portable one (K and V repeated per query head)")
    parser.add_argument("--adam", choices=ADAM_KINDS, default=None,
                        help="the Adam Megatron builds: te (TE's FusedAdam), apex, torch (AdamW, "
                        "multi-tensor on CUDA); default: te with --transformer-engine true, else torch")
    parser.add_argument("--teacher-hf-config", help="a colocated distillation teacher's HF config.json "
                        "(or its directory), planned at --teacher-train, offloaded between uses")
    parser.add_argument("--teacher-train", default="tp=1", help="the teacher's layout: tp=,pp=,ep=")
    parser.add_argument("overrides", nargs="*", help="with --config: dotted overrides, as the training "
                        "script takes them (actor.recompute.granularity=full ...)")
    parser.add_argument("--reserve-gb", type=float, default=mp.RUNTIME_RESERVE_GB,
                        help="per GPU, not PyTorch tensors (assumed)")
    return parser


def parse_recompute(text: str) -> RecomputeConfig:
    """'none' | 'selective[:a+b]' | 'full[:uniform|block[:N]]' -> RecomputeConfig."""
    parts = text.split(":")
    granularity = parts[0]
    if granularity == "full":
        method = parts[1] if len(parts) > 1 else "uniform"
        layers = parts[2] if len(parts) > 2 else "1"
        if not layers.isdigit():
            raise ValueError(f"--recompute {text!r}: the layer count {layers!r} must be a positive integer")
        return RecomputeConfig("full", method, int(layers))
    if granularity == "selective" and len(parts) == 2:
        return RecomputeConfig("selective", modules=tuple(parts[1].split("+")))
    if len(parts) > 1 or granularity not in ("none", "selective"):
        raise ValueError(f"--recompute {text!r}: use none, selective[:MODULE+...] (modules: "
                         f"{', '.join(RECOMPUTE_MODULES)}) or full[:uniform|block[:N]]")
    return RecomputeConfig(granularity)


def _from_flags(args, arch) -> mp.MemoryRequest:
    if not args.train:
        raise ValueError("--train is required without --config (e.g. --train tp=4,pp=2,ep=8)")
    if args.nodes < 1 or args.gpus_per_node < 1:
        raise ValueError(f"--nodes {args.nodes} and --gpus-per-node {args.gpus_per_node} must be positive")
    dims = cp.train_dims(args.train, args.nodes * args.gpus_per_node)
    model = mp.TrainedModel(args.micro_batch_tokens, parse_recompute(args.recompute),
                            OptimizerOffloadConfig(fraction=args.optimizer_offload))
    teacher = None
    if args.teacher_hf_config:
        try:
            teacher_dims = cp.train_dims(args.teacher_train, dims.world_size)
        except ValueError as error:
            raise ValueError(f"--teacher-train {args.teacher_train!r}: {error}") from None
        teacher = mp.TeacherModel(args.teacher_hf_config, cp.arch_of(_read_config(args.teacher_hf_config,
                                                                                   "--teacher-hf-config")),
                                  teacher_dims, args.micro_batch_tokens)
    return mp.MemoryRequest(
        arch=arch, dims=dims, rollout=cp.rollout_layout(args.rollout), teacher=teacher,
        device_bytes=args.gpu_memory_gb * mp.GB, actor=model, critic=model if args.critic else None,
        gpus_per_node=args.gpus_per_node, offload_params=args.offload_params,
        transformer_engine=args.transformer_engine == "true", adam=args.adam,
        engine_fraction=args.engine_fraction, bucket_bytes=args.bucket_mb * 2**20,
        export_hf=not args.no_export, runtime_bytes=args.reserve_gb * mp.GB,
        quantization=args.rollout_quantization, router_fp32=not args.no_router_fp32)


def _from_run(args, hf_config: dict) -> mp.MemoryRequest:
    from megarl.planning.config import RunConfig
    from megarl.planning.resolved import resolve
    from megarl.planning.typed_config import load

    config = load(RunConfig, args.config, [f"model.hf_dir={os.path.dirname(args.hf_config)}",
                                           "data.path=unused.jsonl", *args.overrides])
    run = resolve(config, {**hf_config, "dtype": args.dtype} if args.dtype else hf_config)
    gpu_gb = config.layout.gpu_memory_gb or args.gpu_memory_gb
    return mp.request_for_run(run, gpu_gb * mp.GB, gpu=True, runtime_bytes=args.reserve_gb * mp.GB)


def _print(stages, verdict: dict) -> None:
    phases = list(verdict["phase_peaks_gb"])
    rows = [["stage"] + phases] + [[str(s.stage)] + [f"{s.phases.get(p, 0) / mp.GB:.1f}" for p in phases]
                                   for s in stages]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    print("GB per GPU, by pipeline stage and phase:")
    for row in rows:
        print("  ".join(cell.rjust(w) for cell, w in zip(row, widths)))
    spec = "Transformer Engine's (flash attention)" if verdict["transformer_engine"] else \
        "the portable one (K and V repeated per query head)"
    print(f"layer spec: {spec}; Adam: {ADAM_NAMES[verdict['adam']]}")
    if verdict["teacher"]:
        teacher = verdict["teacher"]
        where = "off the GPU outside" if teacher["offload"] else "kept beyond"
        print(f"teacher {teacher['name']}: tp={teacher['layout']['tp']}, pp={teacher['layout']['pp']}, "
              f"ep={teacher['layout']['ep']}, its weights {where} its teacher_logprobs phase")
    print(f"stage {verdict['binding_stage']}'s terms (GB): " + ", ".join(
        f"{k} {v}" for k, v in verdict["terms_gb"].items() if v))
    print(f"peak {verdict['peak_gb_per_gpu']} GB of {verdict['device_gb']} GB in {verdict['binding_phase']}"
          f" (headroom {verdict['headroom_gb']} GB): {'fits' if verdict['fits'] else 'does NOT fit'}")
    if not verdict["fits"]:
        print(mp.refusal(verdict))


def _read_config(path: str, flag: str) -> dict:
    config_file = os.path.join(path, "config.json") if os.path.isdir(path) else path
    if not os.path.isfile(config_file):
        raise ValueError(f"{flag} {path!r}: no such file (pass a config.json or its directory)")
    with open(config_file) as f:
        return json.load(f)


def main(argv=None) -> dict:
    args = _parser().parse_args(argv)
    try:
        hf_config = _read_config(args.hf_config, "--hf-config")
        if args.overrides and not args.config:
            raise ValueError(f"overrides {args.overrides} need --config (a run's YAML to override)")
        request = _from_run(args, hf_config) if args.config else \
            _from_flags(args, cp.arch_of(hf_config, args.dtype))
        stages = mp.plan_memory(request)
    except ValueError as error:
        sys.exit(f"plan_memory: {error}")
    verdict = mp.summary(request, stages)
    _print(stages, verdict)
    print(json.dumps(verdict))
    return verdict


if __name__ == "__main__":
    main()
