"""A teacher model on the training ranks: an HF checkpoint of any supported family built as a
Megatron model at a layout of its own (teacher.tp/pp/ep; the rest of the world its data parallel)
and run forward only, giving each token of a batch its log-prob and whether it is the teacher's
most likely token. Between uses its parameters live on the host (teacher.offload).

Owns building and loading it under its own Megatron groups (megatron_groups.create_layout; every
build, load and forward runs inside megatron_groups.using), its offload, and its forward pass.
Does not own the distillation term (algos/distill.py) or how the loop uses it (trainer/loop.py).
"""

import contextlib
from functools import partial
from typing import List, Optional

import torch

from megarl.actor import offload
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
                 offload_params: bool = True, timeout_s: float = 600.0, **transformer_overrides):
        """Collective over the world: the teacher's groups are made on every rank (`dims`:
        resolved.teacher_dims, validated)."""
        self.arch, self.batching = arch, batching
        self.layout = megatron_groups.create_layout(dims, timeout_s)
        with megatron_groups.using(self.layout):
            self.chunks: List[torch.nn.Module] = build_model(arch, dims, perform_initialization=False,
                                                             **transformer_overrides)
            load_hf_weights(self.chunks, arch, hf_dir)
        for chunk in self.chunks:
            chunk.eval()
            chunk.requires_grad_(False)
        self.offload = offload_params
        self.parked: Optional[offload.Offloaded] = None  # the parameters' host copies between uses
        if offload_params:
            self._park()

    @property
    def device_bytes(self) -> int:
        """The bytes the teacher's parameters hold on the device now (0 while parked)."""
        return sum(s.nbytes() for s in self._storages())

    def _storages(self) -> List[torch.UntypedStorage]:
        return offload.distinct_storages(p for chunk in self.chunks for p in chunk.parameters())

    def _park(self) -> None:
        self.parked = offload.to_host(self._storages())

    @contextlib.contextmanager
    def _on_device(self):
        """The parameters on the device for the block, back on the host after it (teacher.offload)."""
        if self.parked is not None:
            offload.reload(self.parked)
            self.parked = None
        try:
            yield
        finally:
            if self.offload:
                self._park()

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
        with megatron_groups.using(self.layout), self._on_device():
            micro_batches = local_micro_batches(batch, torch.arange(batch.size), self.batching)
            outputs = run_micro_batches(self.chunks, micro_batches, lambda mb: partial(self._report, mb),
                                        forward_only=True)
            both = share_rows([o["both"] for o in outputs], micro_batches, (batch.size, batch.width, 2),
                              torch.float32, megatron_groups.device()).cpu()
        return batch.with_fields(teacher_logprobs=both[..., 0], teacher_top1=both[..., 1])

    def shutdown(self) -> None:
        """Nothing outlives the run's processes."""
