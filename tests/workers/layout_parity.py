"""torchrun worker: several parallel layouts of one world size, several models each. For each
layout, rebuild Megatron's groups; for each model, load its Megatron checkpoint at the layout,
compare forward and backward with HF transformers, and have rank 0 save the summary, loss and full
gradients to OUT_DIR/LAYOUT/NAME.pt. One launch serves many layouts and models."""

import argparse
import json
import os

import torch

from megarl.checks import parity
from megarl.parallel_state import megatron_groups
from megarl.parallel_state.dims import ParallelDims


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--layouts", required=True, help="JSON list of [layout name, ParallelDims "
                                                         "fields, [[name, hf_dir, megatron_dir]]]")
    parser.add_argument("--out-dir", required=True)
    args = parser.parse_args()
    world = megatron_groups.init_distributed()
    for layout, fields, cases in json.loads(args.layouts):
        dims = ParallelDims(world_size=world, **fields)
        megatron_groups.initialize(dims)
        out_dir = os.path.join(args.out_dir, layout)
        os.makedirs(out_dir, exist_ok=True)
        for name, hf_dir, megatron_dir in cases:
            summary, ours = parity.check_checkpoint(hf_dir, megatron_dir, dims, grads=True)
            if megatron_groups.is_rank0():
                torch.save({"summary": summary, "loss": ours.loss, "grads": ours.grads},
                           os.path.join(out_dir, f"{name}.pt"))
    megatron_groups.destroy()


if __name__ == "__main__":
    main()
