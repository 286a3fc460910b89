"""torchrun worker: several parallel layouts of one world size, several models each. For each
layout, rebuild Megatron's groups; for each model, load its Megatron checkpoint at the layout,
compare forward and backward with HF transformers, and have rank 0 save the summary, loss and full
gradients to OUT_DIR/LAYOUT/NAME.pt. One launch serves many layouts and models.

A case with a PEFT LoRA folder compares the adapted model with HF transformers + PEFT (the
adapters' gradients), after saving the adapters again as PEFT (OUT_DIR/LAYOUT/NAME.peft) before
any update. --lora-refusals records what attaching a MoE model's adapters at expert TP > 1 says
(OUT_DIR/refusals.json)."""

import argparse
import json
import os
from dataclasses import replace

import torch

from megarl.checks import parity
from megarl.models.hf.config import arch_from_hf_config
from megarl.models.lora import peft_io
from megarl.models.megatron.builder import build_model
from megarl.models.weights import checkpoint
from megarl.parallel_state import megatron_groups
from megarl.parallel_state.dims import ParallelDims


def _adapted(megatron_dir: str, adapter_dir: str, dims: ParallelDims):
    """The model at `dims` with the folder's adapters, as a run with actor.lora.init starts."""
    arch = arch_from_hf_config(checkpoint.read_model_file(megatron_dir)["hf_config"])
    chunks = build_model(arch, dims, perform_initialization=False)
    checkpoint.load(chunks, megatron_dir)
    config = replace(peft_io.read_config(adapter_dir, arch), init=adapter_dir)
    peft_io.start(chunks, arch, config)
    return arch, chunks, config


def _round_trip(megatron_dir: str, adapter_dir: str, dims: ParallelDims, out: str) -> None:
    arch, chunks, config = _adapted(megatron_dir, adapter_dir, dims)
    peft_io.save(chunks, arch, config, out)


def _refusal(call) -> str:
    try:
        call()
    except ValueError as error:
        return str(error)
    return "accepted"


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--layouts", required=True,
                        help="JSON list of [layout name, ParallelDims fields, [[name, hf_dir, megatron_dir"
                             "(, PEFT adapter_dir)]]]")
    parser.add_argument("--out-dir", required=True)
    parser.add_argument("--lora-refusals", help="JSON [megatron_dir, adapter_dir] of a MoE model")
    args = parser.parse_args()
    world = megatron_groups.init_distributed()
    for layout, fields, cases in json.loads(args.layouts):
        dims = ParallelDims(world_size=world, **fields)
        megatron_groups.initialize(dims)
        out_dir = os.path.join(args.out_dir, layout)
        os.makedirs(out_dir, exist_ok=True)
        for name, hf_dir, megatron_dir, *adapter in cases:
            adapter_dir = adapter[0] if adapter else None
            if adapter_dir:
                _round_trip(megatron_dir, adapter_dir, dims, os.path.join(out_dir, f"{name}.peft"))
            summary, ours = parity.check_checkpoint(hf_dir, megatron_dir, dims, grads=True,
                                                    adapter_dir=adapter_dir)
            if megatron_groups.is_rank0():
                torch.save({"summary": summary, "loss": ours.loss, "grads": ours.grads},
                           os.path.join(out_dir, f"{name}.pt"))
    if args.lora_refusals:
        megatron_dir, adapter_dir = json.loads(args.lora_refusals)
        dims = ParallelDims(world_size=world, tp=world)  # expert TP follows TP
        megatron_groups.initialize(dims)
        refused = {"expert_tp": _refusal(lambda: _adapted(megatron_dir, adapter_dir, dims))}
        if megatron_groups.is_rank0():
            with open(os.path.join(args.out_dir, "refusals.json"), "w") as f:
                json.dump(refused, f)
    megatron_groups.destroy()


if __name__ == "__main__":
    main()
