"""torchrun worker: at each of several layouts of one world size, build the value model (policy
trunk + ValueHead) from an HF checkpoint that carries a `score.weight` head, and have rank 0 save
the values `Critic.values` computes on a fixed batch ([B, S], column i: the value of the state
before token i) to OUT_DIR/LAYOUT.pt; and, from a *ForSequenceClassification copy of the same
model, the reward model's scores of rm_rows."""

import argparse
import json
import os

import torch

from megarl.actor.config import BatchingConfig
from megarl.checks import parity
from megarl.critic.config import CriticConfig
from megarl.critic.critic import Critic
from megarl.critic.reward_model import RewardModel
from megarl.models.hf.config import load_arch
from megarl.models.hf.weights_io import load_hf_weights
from megarl.models.megatron.builder import build_model
from megarl.parallel_state import megatron_groups
from megarl.parallel_state.dims import ParallelDims
from megarl.rewards.functions import Request

PAD = 7  # tests/test_value_model.py saves the reward models with this pad_token_id


def rm_rows(vocab_size: int):
    """Sequences of several lengths for the reward model, one of them ending in two PADs."""
    tokens = parity.fixed_tokens(vocab_size, 4, 32)
    rows = [row[:n].tolist() for row, n in zip(tokens, (32, 17, 5, 26))]
    rows[1] += [PAD, PAD]
    return rows


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--layouts", required=True,
                        help="JSON list of [layout name, ParallelDims fields, hf_dir, reward model dir]")
    parser.add_argument("--out-dir", required=True)
    args = parser.parse_args()
    world = megatron_groups.init_distributed()
    for layout, fields, hf_dir, rm_dir in json.loads(args.layouts):
        dims = ParallelDims(world_size=world, **fields)
        megatron_groups.initialize(dims)
        arch = load_arch(hf_dir)
        chunks = build_model(arch, dims, role="value")
        written, _ = load_hf_weights(chunks, arch, hf_dir, role="value")
        batch = parity.scored_batch(parity.fixed_tokens(arch.vocab_size, 4, 32))
        values = Critic(chunks, CriticConfig()).values(batch).values
        rows = rm_rows(arch.vocab_size)
        scores = RewardModel(rm_dir, dims, BatchingConfig(), None)([Request("", "")] * len(rows), rows)
        if megatron_groups.is_rank0():
            torch.save({"values": values, "written": written, "rm_scores": scores},
                       os.path.join(args.out_dir, f"{layout}.pt"))
    megatron_groups.destroy()


if __name__ == "__main__":
    main()
