"""torchrun worker: one parallel layout, several models. For each model, load its Megatron
checkpoint at the layout, compare forward and backward with HF transformers, and have rank 0
save the summary, loss and full gradients to OUT_DIR/NAME.pt. One launch serves many models."""

import argparse
import json
import os

import torch

from megarl.checks import parity
from megarl.parallel_state import megatron_groups
from megarl.parallel_state.dims import ParallelDims


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--layout", required=True, help="JSON of ParallelDims fields")
    parser.add_argument("--cases", required=True, help="JSON list of [name, hf_dir, megatron_dir]")
    parser.add_argument("--out-dir", required=True)
    args = parser.parse_args()
    world = megatron_groups.init_distributed()
    dims = ParallelDims(world_size=world, **json.loads(args.layout))
    megatron_groups.initialize(dims)
    for name, hf_dir, megatron_dir in json.loads(args.cases):
        summary, ours = parity.check_checkpoint(hf_dir, megatron_dir, dims, grads=True)
        if megatron_groups.is_rank0():
            torch.save({"summary": summary, "loss": ours.loss, "grads": ours.grads},
                       os.path.join(args.out_dir, f"{name}.pt"))
    megatron_groups.destroy()


if __name__ == "__main__":
    main()
