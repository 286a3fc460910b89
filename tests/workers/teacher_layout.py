"""torchrun worker (2 ranks): the actor at TP1 x PP2 and colocated teachers at layouts of their
own in the same world, scoring one batch of the test's tokens. Rank 0 saves to OUT: the actor's
old log-probs before and after the teachers ran; each teacher's log-probs and top-1 flags (twice
for the offloaded one, with its parameters' device bytes when parked and after a use, and its host
copy's bytes); the teacher of the student's own checkpoint and layout; the batch's tensors."""

import argparse

import torch
import torch.distributed as dist
from synthetic_batch import synthetic_batch  # noqa: I001 (next to this script)

from megarl.actor.actor import Actor
from megarl.actor.config import ActorConfig, BatchingConfig
from megarl.models.hf.config import arch_from_hf_config, load_hf_config
from megarl.models.hf.weights_io import load_hf_weights
from megarl.models.megatron.builder import build_model
from megarl.parallel_state import megatron_groups
from megarl.parallel_state.dims import ParallelDims
from megarl.teacher.colocated import ColocatedTeacher


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--student", required=True)
    parser.add_argument("--other", required=True, help="a teacher of another family, the same vocabulary")
    parser.add_argument("--moe", required=True, help="a MoE teacher, the same vocabulary (run at EP2)")
    parser.add_argument("--tokens", required=True, help="the batch's tokens [N, L] (torch.save), for "
                        "synthetic_batch(vocab, max_len=48)'s lengths and mask")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    actor_dims = ParallelDims(world_size=2, pp=2)
    megatron_groups.initialize(actor_dims)
    arch = arch_from_hf_config(load_hf_config(args.student))
    batching = BatchingConfig(micro_batches=2)
    chunks = build_model(arch, actor_dims, perform_initialization=False)
    load_hf_weights(chunks, arch, args.student)
    actor = Actor(chunks, arch, ActorConfig(batching=batching))
    batch = synthetic_batch(arch.vocab_size, max_len=48).with_fields(tokens=torch.load(args.tokens))
    before = actor.logprobs(batch).old_logprobs
    out = {"tokens": batch.tokens, "lengths": batch.lengths, "loss_mask": batch.loss_mask, "old": before}

    # The student's checkpoint at TP2, offloaded between uses: used twice.
    tp2 = ColocatedTeacher(args.student, arch, ParallelDims(world_size=2, tp=2), batching,
                           offload_params=True)
    params = [p for chunk in tp2.chunks for p in chunk.parameters()]
    out["tp2_param_bytes"] = sum(p.numel() * p.element_size() for p in params)
    out["tp2_parked_device_bytes"] = tp2.device_bytes
    out["tp2_host_bytes"] = tp2.parked.host_bytes
    scored = tp2.logprobs(batch)
    out["tp2_after_use_device_bytes"] = tp2.device_bytes
    out["tp2"] = (scored.teacher_logprobs, scored.teacher_top1)
    again = tp2.logprobs(batch)
    out["tp2_again"] = (again.teacher_logprobs, again.teacher_top1)
    with megatron_groups.using(tp2.layout):
        out["tp2_axes"] = (megatron_groups.tensor().size, megatron_groups.pipeline().size,
                           megatron_groups.data().size)
    out["actor_axes"] = (megatron_groups.tensor().size, megatron_groups.pipeline().size,
                         megatron_groups.data().size)

    # Another family (llama for a qwen3 student), data parallel over both ranks, kept on device.
    other_arch = arch_from_hf_config(load_hf_config(args.other))
    other = ColocatedTeacher(args.other, other_arch, ParallelDims(world_size=2), batching,
                             offload_params=False)
    scored = other.logprobs(batch)
    out["other"] = (scored.teacher_logprobs, scored.teacher_top1)
    out["other_device_bytes"] = other.device_bytes

    # A MoE teacher with its experts split over both ranks (EP2, data parallel 2).
    moe_arch = arch_from_hf_config(load_hf_config(args.moe))
    moe = ColocatedTeacher(args.moe, moe_arch, ParallelDims(world_size=2, ep=2), batching)
    scored = moe.logprobs(batch)
    out["moe_ep2"] = (scored.teacher_logprobs, scored.teacher_top1)
    with megatron_groups.using(moe.layout):
        out["moe_ep2_axes"] = (megatron_groups.expert().size, megatron_groups.data().size)

    # Teacher = student: its checkpoint at the actor's layout.
    same = ColocatedTeacher(args.student, arch, actor_dims, batching, offload_params=True)
    out["same"] = same.logprobs(batch).teacher_logprobs

    out["old_after"] = actor.logprobs(batch).old_logprobs  # the actor's groups current again
    if dist.get_rank() == 0:
        torch.save(out, args.out)
    megatron_groups.destroy()


if __name__ == "__main__":
    main()
