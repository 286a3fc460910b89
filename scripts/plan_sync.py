"""Plan a Megatron -> vLLM weight sync for a cluster layout, without weights, and estimate its cost.

  python scripts/plan_sync.py --hf-config docs/configs/qwen3-235b-a22b.json \\
      --train tp=4,pp=2,cp=2,ep=16,etp=1 --rollout tp=8 --nodes 8 --gpus-per-node 8

Builds the plan sync_weights executes (megarl/resharding/cluster_plan.py: the same layout_pieces,
vllm_layout and build_plan; rank r on node r // gpus-per-node) and prints, per rank (all, or the
busiest when there are many) and in total: bytes received and sent within a node and across
nodes, bytes copied locally, P2P messages, planned peak memory (a bucket's opened engine tensors +
its largest round's buffers, as sync.py counts it), and seconds at the stated link speeds.

Seconds model; every constant has a flag (GB/s: 1e9 bytes/s per GPU per direction). One rank in
one round of a bucket, in transport.py's order:
  pre     = (its local copies + copies it sends) x --copy-us
            + bytes copied locally / --hbm-gbps + bytes packed into send buffers / --pack-gbps
  network = max(send, receive): both directions at once (full-duplex links, all of a round's
            messages posted together); send = intra-node bytes / --nvlink-gbps + inter-node
            bytes / --ib-gbps + messages x --message-us (NVLink and InfiniBand add up); receive alike
  post    = copies it receives x --copy-us + bytes unpacked / --hbm-gbps
  + --round-us
Its messages flow once it and its peers in that round have done their `pre`; it then unpacks
and goes on to its next round, waiting for nobody else (each rank runs only its own share of
the plan, indexed once when the plan is built).
`seconds` is when the last rank is done under that schedule; `seconds_barrier` makes each phase
of each round a barrier of all ranks (an upper bound); `seconds_rank_bound` is the busiest rank's own time
alone (a lower bound).
Defaults of --copy-us, --hbm-gbps and --pack-gbps: the GPU kind's, measured against megarl's
transport with bench/bench_sync_copies.py --device cuda --experts 128 --hidden 2048 --width 768
(a Qwen3-30B-A3B TP8 rank's 393 KB expert slabs; megarl/resharding/gpu_kinds.py holds the table,
docs/gpu/sync_copies.json each run's figures, cluster_plan.Links says more). The kind: --gpu
h100|h200, else the visible GPU's (torch.cuda.get_device_name), else h100 where no GPU is
visible (a login node); a GPU of another kind is refused. The output names the kind, how it was
chosen and any constant set apart from it:
                   h100 (2026-11-26)  h200 (2026-11-28)
  --copy-us        7.3                11.7     a batched Copy (its views + its share of the
                                               round's torch._foreach_copy_); on the H100 10.0 us
                                               at 3.67 MB slabs (7.3 + bytes / 1482 GB/s charges
                                               7.57 and 9.78 us)
  --hbm-gbps       1482               2086     a plain 1 GiB device copy: local copies and
                                               unpacking (the same batched copy)
  --pack-gbps      222                95       packing a send buffer with torch.cat (393 KB
                                               slabs, their views included)
Assumed for every kind: NVLink 4 (H100 and H200 SXM) 900 GB/s bidirectional -> 450; one 400 Gb/s
InfiniBand NIC per GPU -> 50; 10 us a message; 100 us a round. One launch per slab, as the
transport wrote copies before it batched them, was 25 us on an H100 (--copy-us 25). Until
2026-11-26 the defaults were 5 us a Copy (measured on a 2-core CPU machine) and 1500 GB/s for
local copies, packing and unpacking alike (--copy-us 5 --hbm-gbps 1500 --pack-gbps 1500).
Not modelled: the engine's per-module processing after a load (vLLM's process_weights_after_
loading), contention between ranks on a shared switch or PCIe link, NCCL's channel limits.

The last line printed is one JSON object.
"""

import argparse
import json
import os
from typing import Optional, Tuple

from megarl.models.weights import engine_fp32, fp8_layout
from megarl.resharding import cluster_plan as cp
from megarl.resharding import gpu_kinds


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--hf-config", required=True, help="an HF config.json, or its directory")
    parser.add_argument("--train", required=True,
                        help="training layout: tp=,pp=,cp=,ep=,etp=,vpp= (dp derived), e.g. tp=4,pp=2,ep=8")
    parser.add_argument("--rollout", required=True, help="engine layout: tp=[,ep=], e.g. tp=8 or tp=8,ep=8")
    parser.add_argument("--nodes", type=int, required=True)
    parser.add_argument("--gpus-per-node", type=int, default=8)
    parser.add_argument("--dtype", default=None, help="the model's dtype (default: the config's)")
    parser.add_argument("--bucket-mb", type=float, default=256.0)
    links, kinds = cp.Links(), gpu_kinds.KINDS.values()

    def per_kind(name: str) -> str:
        return "default: the GPU kind's (" + ", ".join(f"{k.name} {getattr(k, name):g}" for k in kinds) + ")"

    parser.add_argument("--gpu", default=None, metavar="|".join(gpu_kinds.KINDS),
                        help="the GPU kind whose measured constants (--copy-us, --hbm-gbps, --pack-gbps) "
                             "cost the plan; default: the visible GPU's, else h100")
    parser.add_argument("--nvlink-gbps", type=float, default=links.nvlink_gbps,
                        help="GB/s per GPU per direction within a node (NVLink 4: 900 / 2)")
    parser.add_argument("--ib-gbps", type=float, default=links.ib_gbps,
                        help="GB/s per GPU per direction across nodes (400 Gb/s InfiniBand = 50)")
    parser.add_argument("--hbm-gbps", type=float, default=None,
                        help="GB/s of a device-memory copy: local copies and unpacking; "
                             + per_kind("hbm_gbps"))
    parser.add_argument("--pack-gbps", type=float, default=None,
                        help="GB/s of packing a send buffer with torch.cat (393 KB slabs); "
                             + per_kind("pack_gbps"))
    parser.add_argument("--message-us", type=float, default=links.message_us, help="per P2P message")
    parser.add_argument("--copy-us", type=float, default=None,
                        help="per Copy of the plan a rank handles (its views and its share of the "
                             "round's batched copy); " + per_kind("copy_us"))
    parser.add_argument("--round-us", type=float, default=links.round_us, help="per round of a bucket")
    parser.add_argument("--max-regions", type=int, default=cp.MAX_REGIONS,
                        help="above this many destination regions, plan one engine per distinct placement")
    parser.add_argument("--rollout-quantization", choices=("none", "fp8"), default="none",
                        help="fp8: block-FP8 engines (rollout.quantization): report each engine rank's "
                             "FP8 bytes (key 'fp8'); a layout whose slices are not whole blocks is refused")
    parser.add_argument("--no-router-fp32", action="store_true",
                        help="MoE gates in the model's dtype in engines (default fp32, model.router_fp32)")
    parser.add_argument("--all-engines", action="store_true", help="plan every engine, however many")
    parser.add_argument("--show", type=int, default=8, help="ranks listed when there are more than 16")
    parser.add_argument("--lora", default=None, metavar="rank=R[,alpha=A][,targets=K+K]",
                        help="a LoRA actor (targets: module kinds joined by +, default all): also plan "
                             "the adapters-only sync that follows the first (which writes the base: the "
                             "plan above), into vLLM's LoRA slots or, where they cannot serve the "
                             "adapters, merged by the engine from the base it keeps on the host (its "
                             "bytes per engine rank are given) (key 'lora')")
    return parser


def lora_config(text: str):
    """--lora's LoraConfig; ValueError names a bad part."""
    from megarl.models.lora.adapters import LoraConfig

    fields = {}
    for part in text.split(","):
        key, _, value = part.partition("=")
        if key == "rank":
            fields["rank"] = int(value)
        elif key == "alpha":
            fields["alpha"] = float(value)
        elif key == "targets":
            fields["targets"] = tuple(value.split("+"))
        else:
            raise ValueError(f"--lora {text!r}: {part!r} is not rank=, alpha= or targets=")
    if not fields.get("rank"):
        raise ValueError(f"--lora {text!r}: give rank=R (R >= 1)")
    return LoraConfig(**fields)


def plan_lora(result: cp.ClusterPlan, config) -> dict:
    """The adapters-only sync at the plan's layout (resharding/adapter_plan.py): into vLLM's LoRA
    slots, or merged by the engine, with the host bytes of the base each engine rank then keeps
    (the most of any rank: rollout/vllm/merge.py's modules)."""
    from megarl.models.weights.destination import vllm_rank_tensors
    from megarl.resharding import adapter_plan
    from megarl.rollout.vllm.lora import slots_refusal
    from megarl.rollout.vllm.merge import adapted_modules

    refusal = slots_refusal(result.arch, config)
    kept = 0
    if refusal:
        kept = max(sum(t.numel for group in adapted_modules(result.arch, config, vllm_rank_tensors(
            result.arch, result.rollout, p)).values() for t in group) for p in range(result.rollout.size))
    node_of = [rank // result.gpus_per_node for rank in range(result.world)]
    held = adapter_plan.layout_shards(result.arch, result.dims, config)
    return {"slots": refusal is None, "why": refusal, "rank": config.rank, "targets": list(config.targets),
            "kept_base_bytes": kept * cp.DTYPES[result.arch.dtype].itemsize,
            **adapter_plan.plan_adapters(held, range(result.world), node_of, result.links)}


def _load_config(path: str) -> dict:
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    if not os.path.isfile(path):
        raise ValueError(f"--hf-config {path!r}: no such file (pass a config.json or its directory)")
    with open(path) as f:
        return json.load(f)


def links_of(args: argparse.Namespace, device: Optional[str]) -> Tuple[cp.Links, str]:
    """The cost model's constants: the GPU kind's (--gpu, else `device`'s, the visible GPU's name
    or None), any of them set by its own flag; and how the kind was chosen."""
    kind, how = gpu_kinds.choose(args.gpu, device)
    measured = {name: getattr(args, name) for name in cp.MEASURED if getattr(args, name) is not None}
    return cp.Links.of(kind, nvlink_gbps=args.nvlink_gbps, ib_gbps=args.ib_gbps, message_us=args.message_us,
                       round_us=args.round_us, **measured), how


def build(args: argparse.Namespace) -> Tuple[cp.ClusterPlan, str]:
    """The plan the parsed arguments describe, and how its GPU kind was chosen; ValueError names
    what is wrong."""
    if args.nodes < 1 or args.gpus_per_node < 1:
        raise ValueError(f"--nodes {args.nodes} and --gpus-per-node {args.gpus_per_node} must be positive")
    if not args.bucket_mb > 0:
        raise ValueError(f"--bucket-mb must be positive, got {args.bucket_mb}")
    arch = cp.arch_of(_load_config(args.hf_config), args.dtype)
    dims = cp.train_dims(args.train, args.nodes * args.gpus_per_node)
    rollout = cp.rollout_layout(args.rollout)
    if args.rollout_quantization == "fp8":  # before the plan: a misaligned layout is refused at once
        fp8_layout.check_fp8_dtype(arch.dtype)
        fp8_layout.check_fp8_layout(arch, rollout)
    links, how = links_of(args, None if args.gpu else gpu_kinds.visible_device())
    return cp.plan_cluster(arch, dims, rollout, args.gpus_per_node, int(args.bucket_mb * 2**20), links,
                           max_regions=10**18 if args.all_engines else args.max_regions,
                           quantization=args.rollout_quantization, router_fp32=not args.no_router_fp32), how


def _table(result: cp.ClusterPlan, show: int) -> None:
    ranks = sorted(result.ranks.values(), key=lambda s: s.rank)
    if len(ranks) > 16:
        ranks = sorted(ranks, key=lambda s: -s.seconds)[:show]
        print(f"busiest {len(ranks)} of {len(result.ranks)} ranks (by their own time):")
    head = ("rank", "node", "recv intra", "recv inter", "sent intra", "sent inter", "local",
            "msgs sent/recv", "copies", "peak", "own s")
    rows = [head] + [(str(s.rank), str(s.rank // result.gpus_per_node), cp.gb(s.recv_intra),
                      cp.gb(s.recv_inter), cp.gb(s.sent_intra), cp.gb(s.sent_inter), cp.gb(s.local_bytes),
                      f"{s.messages}/{s.messages_received}", str(s.copies), cp.gb(s.peak_bytes),
                      f"{s.seconds:.3f}") for s in ranks]
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    for row in rows:
        print("  ".join(cell.rjust(w) for cell, w in zip(row, widths)))


def plan_fp8(result: cp.ClusterPlan) -> dict:
    """An FP8 engine rank's weights (its ranks hold equal shares): FP8 codes and fp32 block scales
    of the quantized tensors, the rest in the model's dtype (fp32 where the engine holds it so:
    engine_fp32), against an unquantized engine rank's. The sync's figures above count what it
    moves: codes and scales where the senders quantize (every slab of a tensor whole blocks), the
    model's dtype where the engine rank does."""
    itemsize = cp.DTYPES[result.arch.dtype].itemsize
    tensors = engine_fp32.engine_rank_tensors(result.arch, result.rollout, result.router_fp32)
    kept = set(fp8_layout.kept_in_bf16(result.arch, result.rollout))
    fp8 = [t for t in tensors if fp8_layout.is_fp8(t.name, t.shape, kept)]
    return {"engine_bytes_per_rank": sum(fp8_layout.engine_bytes(t, itemsize, True, kept) for t in tensors),
            "unquantized_engine_bytes_per_rank": sum(t.engine_bytes(itemsize) for t in tensors),
            "fp8_code_bytes_per_rank": sum(t.numel for t in fp8),
            "fp8_scale_bytes_per_rank": sum(map(fp8_layout.scale_count, (t.shape for t in fp8)))
            * fp8_layout.SCALE_BYTES,
            "kept_unquantized_modules": len(kept),
            "quantized_by_senders": result.quantized_by_senders,
            "quantized_by_receivers": result.quantized_by_receivers}


def report(result: cp.ClusterPlan, show: int = 8, lora=None, gpu_choice: str = "", fp8: bool = False) -> dict:
    """Print the plan's figures; the last line is the summary as JSON (also returned). `lora`: a
    LoraConfig whose adapters-only sync is planned too; `gpu_choice`: how the GPU kind was chosen;
    `fp8`: the engines are block-FP8 (key 'fp8': plan_fp8)."""
    summary = result.summary()
    gpu = summary["gpu"]
    if gpu_choice:
        gpu["chosen_by"] = gpu_choice
    arch, dims, timing = result.arch, result.dims, result.timing
    params = result.model_bytes / cp.DTYPES[arch.dtype].itemsize
    print(f"model: {arch.architecture}, {params / 1e9:.1f}B parameters (vocabulary padded as "
          f"Megatron pads it), {cp.gb(result.model_bytes)} in {arch.dtype}")
    print("train: " + " ".join(f"{k}={v}" for k, v in dims.describe().items() if k != "world_size")
          + f" (world {result.world} = {result.nodes} nodes x {result.gpus_per_node})")
    print(f"rollout: tp={result.rollout.tp} ep={result.rollout.ep}: {result.engines} engines of "
          f"{result.rollout.size} ranks; {result.note()}")
    print(f"plan: {result.buckets} buckets of {result.bucket_bytes / 2**20:g} MiB, {timing.rounds} rounds "
          f"({timing.ranks_per_round:.1f} ranks exchanging, {timing.receivers_per_round:.1f} receiving "
          f"per round on average), {result.copies} copies; built in {result.plan_seconds:.1f} s, "
          f"costed in {result.stats_seconds:.1f} s")
    _table(result, show)
    every = result.ranks.values()
    print(f"total: {cp.gb(sum(s.recv_intra for s in every))} moved within nodes, "
          f"{cp.gb(sum(s.recv_inter for s in every))} across nodes, "
          f"{cp.gb(sum(s.local_bytes for s in every))} copied locally, {summary['messages']} messages"
          + ("" if result.complete else " (planned engines only)"))
    print(f"per rank, max: received {cp.gb(summary['max_bytes_received_per_rank'])}, sent "
          f"{cp.gb(summary['max_bytes_sent_per_rank'])}, inter-node "
          f"{cp.gb(summary['max_bytes_inter_node_per_rank'])}, shard "
          f"{cp.gb(summary['max_shard_bytes_per_rank'])}, messages sent {summary['max_messages_per_rank']}, "
          f"peak {cp.gb(summary['peak_bytes_per_rank'])}")
    print(f"GPU constants: {gpu_kinds.KINDS[gpu['kind']].describe()}"
          + (f"; chosen by {gpu_choice}" if gpu_choice else "")
          + (f"; set apart by flags: {', '.join(gpu['set_apart'])}" if gpu["set_apart"] else ""))
    print("assumptions: " + ", ".join(f"{k} {v:g}" for k, v in summary["assumptions"].items() if k != "gpu"))
    busiest = result.ranks[summary["busiest_rank"]]
    print("busiest rank, whole sync: " + cp.arithmetic(busiest, result.links))
    terms = summary["busiest_rank_seconds_by_term"]
    print(f"seconds: {timing.seconds:.3f} (dependency schedule); bounds: {timing.seconds_rank_bound:.3f} "
          f"(busiest rank alone) .. {timing.seconds_barrier:.3f} (every phase a barrier); the busiest "
          f"rank's largest term: {summary['floor']} ({terms[summary['floor']]:.3f} s of "
          f"{sum(terms.values()):.3f})")
    if lora is not None:
        summary["lora"] = plan_lora(result, lora)
        _lora_lines(summary["lora"], summary["seconds"])
    if fp8:
        summary["fp8"] = plan_fp8(result)
        q = summary["fp8"]
        print(f"FP8 engines: each engine rank holds {cp.gb(q['engine_bytes_per_rank'])} (FP8 codes "
              f"{cp.gb(q['fp8_code_bytes_per_rank'])}, block scales {cp.gb(q['fp8_scale_bytes_per_rank'])}, "
              f"the rest in {result.arch.dtype}; {q['kept_unquantized_modules']} MLP modules, not whole "
              f"blocks, kept unquantized) against {cp.gb(q['unquantized_engine_bytes_per_rank'])} "
              f"unquantized. Of the FP8 tensors the engine ranks receive, {q['quantized_by_senders']} "
              f"come as codes and scales quantized by their senders (every slab whole blocks), "
              f"{q['quantized_by_receivers']} in {result.arch.dtype}, quantized by the receiving rank; "
              "the bytes above count both")
    print(json.dumps(summary))
    return summary


def _lora_lines(plan: dict, full_seconds: float) -> None:
    busiest = plan["busiest_rank"]
    print(f"LoRA rank {plan['rank']} ({'+'.join(plan['targets'])}): the first sync writes the base (the "
          f"plan above); each later one moves the adapters alone: {cp.gb(plan['adapter_bytes'])} onto "
          f"each of {plan['receivers']} engine ranks, {plan['shards']} shards; per rank, max: sent "
          f"{cp.gb(plan['max_sent_bytes'])} ({cp.gb(plan['max_sent_inter_bytes'])} across nodes), "
          f"{plan['max_messages']} messages; {plan['seconds']:.4f} s against {full_seconds:.3f} s "
          f"(busiest rank {busiest['rank']}: {cp.gb(busiest['local_bytes'])} local, "
          f"{cp.gb(busiest['recv_intra'] + busiest['recv_inter'])} received)")
    if not plan["slots"]:
        print(f"LoRA: merged by the engine, not served from vLLM's slots ({plan['why']}): each engine "
              f"rank keeps the adapted modules' base on the host, {cp.gb(plan['kept_base_bytes'])} at most, "
              "and reads it back each merge (on a GPU a host-to-device copy, not in the seconds above)")


def main(argv=None) -> dict:
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        lora = lora_config(args.lora) if args.lora else None
        result, how = build(args)
    except ValueError as error:
        parser.error(str(error))
    return report(result, args.show, lora, how, fp8=args.rollout_quantization == "fp8")


if __name__ == "__main__":
    main()
