"""Verify a Megatron -> vLLM weight sync end to end at a chosen layout.

  torchrun --nproc-per-node N scripts/verify_sync.py --hf-dir IN --tp A --pp B --ep C \\
      [--first-stage-layers F] [--last-stage-layers L] --rollout-tp R --perturb 0.01

Loads IN into the Megatron actor at the layout (a layer count --pp does not divide split as the
converter splits it unless --first/--last-stage-layers say how: megarl/checks/layout_flags.py),
perturbs it (as training would), generates with vLLM before and after syncing, and compares vLLM's
sampled-token log-probs with the actor's teacher-forced log-probs; with --loader-parity, also the
engine's tensors with those vLLM's own loaders make of the same weights. With --export DIR, it
writes the perturbed actor as an HF checkpoint (DIR/hf) and the post-sync samples
(DIR/samples.json): a vLLM engine started from DIR/hf with the same --prompts, --max-new-tokens and
--seed must reproduce them (the sync adds nothing to the engine's own error;
tests/test_weight_sync.py does so for MLA). The last line printed is one JSON object; its `layout`
names the stages' sizes when they are uneven.
"""

import argparse
import dataclasses
import json
import sys

import torch

from megarl.checks import weight_sync as verify
from megarl.checks.layout_flags import add_layout_flags, layout
from megarl.checks.loader_parity import loader_parity
from megarl.models.hf.config import load_arch
from megarl.models.hf.weights_io import load_hf_weights
from megarl.models.lora import peft_io
from megarl.models.lora.adapters import LoraConfig
from megarl.models.megatron.builder import build_model
from megarl.models.weights.destination import RolloutLayout
from megarl.parallel_state import megatron_groups
from megarl.resharding import sync_weights
from megarl.resharding.adapter_sync import push_weights
from megarl.rollout.vllm import fp8_engine as vllm_fp8
from megarl.rollout.vllm import lora as vllm_lora
from megarl.rollout.vllm.engine import VLLMEngine


def _per_rank(mine: dict, world: int) -> list:
    """Every rank's `mine`, in rank order (collective)."""
    ranks = [mine] * world
    if world > 1:
        torch.distributed.all_gather_object(ranks, mine)
    return ranks


def _across_push(chunks, arch, engine, prompts, sampling, args) -> dict:
    """The routing replay of samples continued across a weight push (--push-after-steps)."""
    def push():
        verify.perturb(chunks, arch, args.perturb, args.seed + 1)
        sync_weights(chunks, arch, engine, bucket_bytes=int(args.bucket_mb * 2**20))

    samples, interrupted = verify.streamed_across_push(engine, prompts, sampling, args.push_after_steps, push)
    newest = [s for s in samples if int(s.versions.max()) == 1]  # lag 0: finished by the actor's weights
    return {"interrupted": interrupted, "samples": len(newest),
            "continued": sum(int(s.versions.min()) == 0 for s in newest),
            "tokens_of_version_1": sum(int((s.versions == 1).sum()) for s in newest),
            **verify.routing_replay_report(chunks, arch, newest, version=1)}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--hf-dir", required=True)
    add_layout_flags(parser, context_parallel=False)
    parser.add_argument("--rollout-tp", type=int, default=1)
    parser.add_argument("--rollout-ep", type=int, default=1,
                        help="1, or the rollout tp: experts split over each engine's ranks")
    parser.add_argument("--perturb", type=float, default=0.01, help="relative noise scale")
    parser.add_argument("--bucket-mb", type=float, default=256.0)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-logprob-diff", type=float, default=1e-4,
                        help="exit 1 if the post-sync difference exceeds this")
    parser.add_argument("--loader-parity", action="store_true",
                        help="also compare the engine's synced tensors with vLLM's own loader's "
                             "(from an HF export of the actor); exit 1 unless they are equal. "
                             "Dense models on the CPU (megarl/checks/loader_parity.py)")
    parser.add_argument("--dtype", default=None, choices=["float32", "bfloat16"],
                        help="run actor and engine in this dtype (default: the checkpoint's)")
    parser.add_argument("--routing", action="store_true",
                        help="MoE: the engine returns each token's experts; report, for router "
                             "replay off and rollout (R3), the log-prob difference and the fraction "
                             "of (token, layer) pairs routed differently (key 'routing')")
    parser.add_argument("--push-after-steps", type=int, default=0, metavar="K",
                        help="with --routing: then stream the prompts turn by turn, perturb and sync "
                             "again after K engine steps, continue the unfinished requests with the "
                             "new weights, and report the routing replay of the samples the new "
                             "weights finished, over the tokens they sampled (key 'across_push')")
    parser.add_argument("--no-router-fp32", action="store_true",
                        help="MoE gates in the model's dtype in both actor and engine (default: fp32, "
                             "as model.router_fp32)")
    parser.add_argument("--lora-init", default=None, metavar="PEFT_DIR",
                        help="LoRA adapters from a PEFT folder on the perturbed actor: the sync sends "
                             "the weights with them merged in, and vLLM must match the adapted actor")
    parser.add_argument("--adapters-only", action="store_true",
                        help="with --lora-init: the engine takes the adapters alone, into vLLM's LoRA "
                             "slots where it can serve them, else merged into its weights by the engine. "
                             "The first sync writes the base weights and the adapters; then the adapters "
                             "are perturbed (as training moves them) and a second sync sends them alone; "
                             "the log-probs compared are after the second, and a third sync of the same "
                             "adapters must leave the engine's weights as they were (key 'adapter_sync')")
    parser.add_argument("--rollout-quantization", default="none", choices=["none", "fp8"],
                        help="fp8: a block-FP8 engine, quantized at each sync (rollout/vllm/fp8_engine.py: "
                             "by the senders where their slabs are whole blocks, key quantized_by_senders); "
                             "--loader-parity then compares with vLLM loading the same weights as a "
                             "block-FP8 checkpoint")
    parser.add_argument("--export", default=None, metavar="DIR",
                        help="write DIR/hf (the perturbed actor, HF format) and DIR/samples.json "
                             "(the samples generated after the sync)")
    args = parser.parse_args()
    if args.push_after_steps < 0 or (args.push_after_steps and not args.routing):
        parser.error(f"--push-after-steps {args.push_after_steps}: give a number of engine steps >= 1 "
                     "together with --routing (it reports the routing replay across the push)")
    if args.adapters_only and not args.lora_init:
        parser.error("--adapters-only needs --lora-init PEFT_DIR: the adapters the sync sends")

    world = megatron_groups.init_distributed()
    arch = load_arch(args.hf_dir, args.dtype)
    dims = layout(args, world, arch.num_layers)
    megatron_groups.initialize(dims, seed=args.seed)
    overrides = {"moe_router_dtype": None} if args.no_router_fp32 else {}
    chunks = build_model(arch, dims, perform_initialization=False, **overrides)
    load_hf_weights(chunks, arch, args.hf_dir)
    verify.perturb(chunks, arch, args.perturb, args.seed)
    adapters = peft_io.run_config(LoraConfig(init=args.lora_init), arch)
    peft_io.start(chunks, arch, adapters)
    spec = vllm_lora.AdapterSpec(arch, adapters) if args.adapters_only else None

    engine = VLLMEngine(args.hf_dir, rollout_tp=args.rollout_tp, rollout_ep=args.rollout_ep,
                        dtype=arch.dtype, seed=args.seed, return_routing=args.routing,
                        router_fp32=not args.no_router_fp32, adapters=spec,
                        quantization=args.rollout_quantization)
    prompts = verify.fixed_prompts(arch.vocab_size, args.prompts, args.seed)
    mine = [prompts[i] for i in engine.placement.share(len(prompts))]
    sampling = verify.default_sampling(args.max_new_tokens, args.seed)
    actor = verify.checking_actor(chunks, arch)

    adapter_sync = None
    if spec is None:
        before = verify.actor_logprob_diff(actor, verify.all_samples(engine.generate(mine, sampling)))
        report = sync_weights(chunks, arch, engine, bucket_bytes=int(args.bucket_mb * 2**20))
    else:  # such an engine generates once adapters are loaded: "before" is the old adapters'
        first = push_weights(chunks, arch, engine, bucket_bytes=int(args.bucket_mb * 2**20))
        verify.perturb_adapters(chunks, args.perturb, args.seed + 1)
        before = verify.actor_logprob_diff(actor, verify.all_samples(engine.generate(mine, sampling)))
        second = push_weights(chunks, arch, engine, bucket_bytes=int(args.bucket_mb * 2**20))
        live = engine.live_weights()
        push_weights(chunks, arch, engine)  # the same adapters again: nothing may move
        drift = max(float((live[name] - t).abs().max()) for name, t in engine.live_weights().items()
                    if t.numel())
        report = first.base
        rows = _per_rank(dataclasses.asdict(second), world)
        drifts = [r["d"] for r in _per_rank({"d": drift}, world)]
        adapter_sync = {"slots": spec.slots, "repeat_max_abs_change": drifts,
                        "base_written": [first.base is not None, second.base is not None],
                        "adapter_bytes": second.adapter_bytes,
                        **{key: [r[key] for r in rows] for key in (
                            "bytes_received", "bytes_sent", "local_bytes", "messages", "sync_seconds")}}
    samples = verify.all_samples(engine.generate(mine, sampling))
    after = verify.actor_logprob_diff(actor, samples)
    ranks = _per_rank(dataclasses.asdict(report), world)
    result = {"layout": dims.describe(), "rollout_tp": args.rollout_tp, "rollout_ep": args.rollout_ep,
              "family": arch.family, "max_abs_logprob_diff": after,
              "max_abs_logprob_diff_before_sync": before,
              "params_synced": report.params_synced, "params_expected": report.params_expected,
              "buckets": report.buckets, "sync_seconds": report.sync_seconds,
              # per rank: engine tensors in fp32 that the planners count in the model's dtype, or
              # the other way round (expected: none)
              "engine_fp32_mismatches": [
                  r["m"] for r in _per_rank({"m": verify.fp32_mismatches(engine, arch)}, world)],
              "model_bytes": report.model_bytes, "samples": len(samples),
              # per rank, in rank order
              **{key: [r[key] for r in ranks] for key in (
                  "bytes_received", "bytes_sent", "local_bytes", "shard_bytes", "messages",
                  "messages_received", "peak_extra_bytes", "measured_peak_bytes",
                  "largest_tensor_bytes", "quantized_by_senders")},
              # per rank: [peer, dtype, bytes] as its transport counted them
              **{key: [sorted([peer, dtype, n] for (peer, dtype), n in r[key].items()) for r in ranks]
                 for key in ("received_from", "sent_to")}}
    if adapter_sync is not None:
        result["adapter_sync"] = adapter_sync
    if args.routing:
        result["routing"] = verify.routing_replay_report(chunks, arch, samples)
        # what the engine's MoE gates compute in (fp32 unless --no-router-fp32)
        result["routing"]["engine_gate_dtypes"] = sorted(
            {str(t.dtype) for name, t in engine.live_weights().items()
             if name.endswith((".gate.weight", ".mlp.router.weight"))})  # gpt-oss: mlp.router
    if args.push_after_steps:
        result["across_push"] = _across_push(chunks, arch, engine, mine, sampling, args)
    if args.export:
        verify.export_synced(chunks, arch, args.hf_dir, samples, args.export)
    if args.loader_parity:
        fp8 = None if args.rollout_quantization == "none" else vllm_fp8.quantization_config(
            arch, RolloutLayout(args.rollout_tp, args.rollout_ep))
        parity = _per_rank(loader_parity(engine, chunks, arch, args.hf_dir, fp8), world)
        result.update({key: [r[key] for r in parity] for key in parity[0]})
    if megatron_groups.is_rank0():
        print(json.dumps(result))
    engine.shutdown()
    megatron_groups.destroy()
    if args.loader_parity and max(result["weight_parity_max_abs_diff"]) > 0:
        sys.exit(f"the synced tensors differ from vLLM's own loader's: "
                 f"{result['weight_parity_max_abs_diff']} (per rank, at {result['weight_parity_worst']})")
    if after > args.max_logprob_diff:
        sys.exit(f"max_abs_logprob_diff {after:.3g} exceeds --max-logprob-diff {args.max_logprob_diff}")


if __name__ == "__main__":
    main()
