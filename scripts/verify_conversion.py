"""Check a Megatron checkpoint against HF transformers at a chosen parallel layout.

  torchrun --nproc-per-node N scripts/verify_conversion.py --hf-dir IN --megatron-dir M \\
      --tp A --pp B --ep C --cp D [--etp E] [--vpp V] [--first-stage-layers F] \\
      [--last-stage-layers L] [--grads] [--dump FILE]

Loads M at the layout, runs the actor's forward (and with --grads its backward) on fixed token
batches, and compares next-token log-probs, loss and full-parameter gradients with an HF
transformers forward and backward of IN. A layer count --pp does not divide is split as the
converter splits it (the first and last stage fewer), unless --first/--last-stage-layers say how,
as a run's layout does (megarl/checks/layout_flags.py). The last line printed is one JSON object;
its `layout` names the stages' sizes when they are uneven.
"""

import argparse
import json
import sys

import torch

from megarl.checks import parity
from megarl.checks.layout_flags import add_layout_flags, layout
from megarl.parallel_state import megatron_groups


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--hf-dir", required=True)
    parser.add_argument("--megatron-dir", required=True)
    add_layout_flags(parser, context_parallel=True)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--micro-batches", type=int, default=2)
    parser.add_argument("--grads", action="store_true", help="also compare loss gradients")
    parser.add_argument("--dump", help="rank 0 saves {summary, loss, grads} here")
    parser.add_argument("--max-logprob-diff", type=float, default=1e-4,
                        help="exit 1 if the max abs log-prob difference exceeds this")
    args = parser.parse_args()

    world = megatron_groups.init_distributed()
    dims = layout(args, world, parity.checkpoint_arch(args.megatron_dir).num_layers)
    megatron_groups.initialize(dims)
    summary, ours = parity.check_checkpoint(args.hf_dir, args.megatron_dir, dims, args.grads,
                                            args.batch, args.seq, args.micro_batches)
    if megatron_groups.is_rank0():
        if args.dump:
            torch.save({"summary": summary, "loss": ours.loss, "grads": ours.grads}, args.dump)
        print(json.dumps(summary))
    megatron_groups.destroy()
    if summary["max_abs_logprob_diff"] > args.max_logprob_diff:
        sys.exit(f"max_abs_logprob_diff {summary['max_abs_logprob_diff']:.3g} exceeds "
                 f"--max-logprob-diff {args.max_logprob_diff}")


if __name__ == "__main__":
    main()
