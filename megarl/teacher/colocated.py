"""A teacher model on the training ranks: an HF checkpoint of any supported family built as a
Megatron model and run forward only, giving each token of a batch its log-prob and whether it is
the teacher's most likely token.

Owns building and loading it, and its forward pass. Does not own the distillation term
(algos/distill.py) or how the loop uses it (trainer/loop.py).
"""

from functools import partial
from typing import List

import torch

from megarl.actor.config import BatchingConfig
from megarl.actor.packing import PackedMicroBatch, unpack_predictions
from megarl.actor.passes import local_micro_batches
from megarl.actor.schedule import forward_only_result, full_pack, run_micro_batches, share_rows
from megarl.algos.vocab_parallel import logprobs_and_entropy, top1_match
from megarl.batch.rollout_batch import RolloutBatch
from megarl.models.hf.config import ModelArch
from megarl.models.hf.weights_io import load_hf_weights
from megarl.models.megatron.builder import build_model
from megarl.parallel_state import megatron_groups
from megarl.parallel_state.dims import ParallelDims


class ColocatedTeacher:
    def __init__(self, hf_dir: str, arch: ModelArch, dims: ParallelDims, batching: BatchingConfig,
                 **transformer_overrides):
        self.arch, self.batching = arch, batching
        self.chunks: List[torch.nn.Module] = build_model(arch, dims, perform_initialization=False,
                                                         **transformer_overrides)
        load_hf_weights(self.chunks, arch, hf_dir)
        for chunk in self.chunks:
            chunk.eval()
            chunk.requires_grad_(False)

    def _report(self, mb: PackedMicroBatch, output: torch.Tensor):
        # output [1, t/cp, V/tp] -> per token: log-prob of the next token and whether it is the top-1
        tp = megatron_groups.tensor()
        group = tp.group if tp.size > 1 else None
        targets = mb.targets[0].to(output.device)
        logprobs, _ = logprobs_and_entropy(output[0], targets, group, self.arch.vocab_size,
                                           entropy_grad=False)
        top1 = top1_match(output[0], targets, group, self.arch.vocab_size).to(logprobs.dtype)
        both = full_pack(torch.stack([logprobs, top1], -1), mb)  # [t, 2]
        return forward_only_result(output, both=unpack_predictions(both, mb))  # [n, W, 2]

    @torch.no_grad()
    def logprobs(self, batch: RolloutBatch) -> RolloutBatch:
        """The batch with teacher_logprobs and teacher_top1 [N, L] filled on every rank. Collective."""
        micro_batches = local_micro_batches(batch, torch.arange(batch.size), self.batching)
        outputs = run_micro_batches(self.chunks, micro_batches, lambda mb: partial(self._report, mb),
                                    forward_only=True)
        both = share_rows([o["both"] for o in outputs], micro_batches, (batch.size, batch.width, 2),
                          torch.float32, megatron_groups.device()).cpu()
        return batch.with_fields(teacher_logprobs=both[..., 0], teacher_top1=both[..., 1])

    def shutdown(self) -> None:
        """Nothing outlives the run's processes."""
