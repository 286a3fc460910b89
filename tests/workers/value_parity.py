"""torchrun worker: build the value model (policy trunk + ValueHead) at one layout from an HF
checkpoint that carries a `score.weight` head, and have rank 0 save the values `Critic.values`
computes on a fixed batch ([B, S], column i: the value of the state before token i)."""

import argparse

import torch

from megarl.checks import parity
from megarl.critic.config import CriticConfig
from megarl.critic.critic import Critic
from megarl.models.builder import build_model
from megarl.models.hf_config import load_arch
from megarl.models.hf_io import load_hf_weights
from megarl.parallel_state import megatron_groups
from megarl.parallel_state.dims import ParallelDims


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--hf-dir", required=True)
    parser.add_argument("--out", required=True)
    for name in ("tp", "pp", "cp", "ep"):
        parser.add_argument(f"--{name}", type=int, default=1)
    args = parser.parse_args()
    world = megatron_groups.init_distributed()
    dims = ParallelDims(world_size=world, tp=args.tp, pp=args.pp, cp=args.cp, ep=args.ep)
    megatron_groups.initialize(dims)
    arch = load_arch(args.hf_dir)
    chunks = build_model(arch, dims, role="value")
    written, _ = load_hf_weights(chunks, arch, args.hf_dir, role="value")
    batch = parity.scored_batch(parity.fixed_tokens(arch.vocab_size, 4, 32))
    values = Critic(chunks, CriticConfig()).values(batch).values
    if megatron_groups.is_rank0():
        torch.save({"values": values, "written": written}, args.out)
    megatron_groups.destroy()


if __name__ == "__main__":
    main()
