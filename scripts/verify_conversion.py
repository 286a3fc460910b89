"""Check a Megatron checkpoint against HF transformers at a chosen parallel layout.

  torchrun --nproc-per-node N scripts/verify_conversion.py --hf-dir IN --megatron-dir M \\
      --tp A --pp B --ep C --cp D [--etp E] [--vpp V] [--grads] [--dump FILE]

Loads M at the layout, runs a forward (and with --grads a backward) on fixed token batches,
and compares log-softmax, loss and full-parameter gradients with an HF transformers forward and
backward of IN. The last line printed is one JSON object.
"""

import argparse
import json

import torch
import torch.distributed as dist

from megarl.models import checkpoint, parity
from megarl.models.builder import build_model
from megarl.models.hf_config import arch_from_hf_config
from megarl.parallel_state import megatron_groups
from megarl.parallel_state.dims import ParallelDims


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--hf-dir", required=True)
    parser.add_argument("--megatron-dir", required=True)
    for name in ("tp", "pp", "ep", "cp"):
        parser.add_argument(f"--{name}", type=int, default=1)
    parser.add_argument("--etp", type=int, default=None)
    parser.add_argument("--vpp", type=int, default=None)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--micro-batches", type=int, default=2)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--grads", action="store_true", help="also compare loss gradients")
    parser.add_argument("--dump", help="rank 0 saves {loss, grads} here for cross-layout checks")
    args = parser.parse_args()

    arch = arch_from_hf_config(checkpoint.read_model_file(args.megatron_dir)["hf_config"])
    world = megatron_groups.init_distributed()
    dims = ParallelDims(world_size=world, tp=args.tp, pp=args.pp, ep=args.ep, cp=args.cp,
                        etp=args.etp, vpp=args.vpp)
    dims.check_sequence(args.seq)
    megatron_groups.initialize(dims)
    chunks = build_model(arch, dims, perform_initialization=False, moe_aux_loss_coeff=0.0)
    checkpoint.load(chunks, args.megatron_dir)
    tokens = parity.fixed_tokens(arch.vocab_size, args.batch, args.seq)
    ours = parity.megatron_run(chunks, arch, tokens, backward=args.grads,
                               micro_batches=args.micro_batches)
    ref = parity.hf_run(args.hf_dir, tokens, backward=args.grads)

    diff = torch.zeros(1, dtype=torch.float64)
    if ours.logprobs is not None:
        diff[0] = (ours.logprobs.double() - ref.logprobs.double()).abs().max()
    dist.all_reduce(diff, op=dist.ReduceOp.MAX)
    result = {"layout": dims.describe(), "family": arch.family,
              "max_abs_logprob_diff": float(diff[0]), "loss": ours.loss, "hf_loss": ref.loss,
              "loss_rel_diff": abs(ours.loss - ref.loss) / abs(ref.loss)}
    if args.grads:
        missing = sorted(set(ref.grads) ^ set(ours.grads))
        if missing:
            raise RuntimeError(f"gradient names differ from HF's: {missing[:10]}")
        rel = {name: parity.relative_diff(ours.grads[name], ref.grads[name]) for name in ref.grads}
        worst = max(rel, key=rel.get)
        result.update(max_grad_rel_diff=rel[worst], worst_grad=worst, num_grads=len(rel))
    if args.dump and megatron_groups.is_rank0():
        torch.save({"loss": ours.loss, "grads": ours.grads, "result": result}, args.dump)
    if megatron_groups.is_rank0():
        print(json.dumps(result))
    megatron_groups.destroy()


if __name__ == "__main__":
    main()
