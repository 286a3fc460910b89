"""Worker: scripts/train_ppo_moe.py as users start it (arguments: --batches DIR, then the script's),
with each step's trained batch saved: the loop's `step` wrapped, the trainers' rank 0 writes
DIR/step_N.pt (the RolloutBatch the actor trained on: rewards, loss mask, old, reference and
teacher log-probs, values, advantages), for a test to recompute the advantages from. Any mode:
rollout ranks of their own never call `step`."""

import importlib.util
import os
import sys

import torch

from megarl.parallel_state import megatron_groups
from megarl.trainer import loop

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main():
    at = sys.argv.index("--batches")
    folder = sys.argv[at + 1]
    del sys.argv[at:at + 2]
    os.makedirs(folder, exist_ok=True)
    step = loop.step

    def saving(run, number):
        result = step(run, number)
        if megatron_groups.is_rank0():
            torch.save(result.rollouts.collected.batch, os.path.join(folder, f"step_{number}.pt"))
        return result

    loop.step = saving  # train() looks `step` up in its module at each call
    path = os.path.join(ROOT, "scripts", "train_ppo_moe.py")
    spec = importlib.util.spec_from_file_location("train_ppo_moe", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    script.main()


if __name__ == "__main__":
    main()
