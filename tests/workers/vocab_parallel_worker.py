"""torchrun worker: vocab-parallel log-probs and entropy at TP = world size over a gloo group,
against torch.log_softmax on the full logits (fp64), whole and in chunks of 1 and 5 tokens (a
last chunk shorter than the rest). Each rank compares its own shard's gradient; rank 0 prints one
JSON object with the worst errors over all ranks and chunk sizes."""

import json

import torch
import torch.distributed as dist

from megarl.algos.vocab_parallel import logprobs_and_entropy

N, SHARD, VOCAB = 24, 8, 13  # padded vocab = SHARD * tp; ids >= VOCAB are output-layer padding


def main():
    dist.init_process_group("gloo")
    rank, tp = dist.get_rank(), dist.get_world_size()
    group = dist.new_group(list(range(tp)), backend="gloo")
    g = torch.Generator().manual_seed(0)
    full = torch.randn(N, SHARD * tp, generator=g, dtype=torch.float64) * 6
    full[:, VOCAB:] = 60.0  # would dominate the softmax and the max shift if not masked
    targets = torch.arange(N) * 5 % VOCAB  # ids on every shard
    weights = torch.randn(2, N, generator=g, dtype=torch.float64)

    ref_logits = full.clone().requires_grad_()
    ref_logp = torch.log_softmax(ref_logits[:, :VOCAB], dim=-1)
    ref_lp = ref_logp.gather(-1, targets[:, None]).squeeze(-1)
    ref_entropy = -(ref_logp.exp() * ref_logp).sum(-1)
    ((weights[0] * ref_lp).sum() + (weights[1] * ref_entropy).sum()).backward()

    ref_grad = ref_logits.grad[:, rank * SHARD:(rank + 1) * SHARD]
    errors = []
    for chunk_tokens in (N, 1, 5):
        shard = full[:, rank * SHARD:(rank + 1) * SHARD].clone().requires_grad_()
        lp, entropy = logprobs_and_entropy(shard, targets, group, vocab_size=VOCAB,
                                           chunk_tokens=chunk_tokens)
        ((weights[0] * lp).sum() + (weights[1] * entropy).sum()).backward()
        errors.append(torch.stack([(lp - ref_lp).abs().max(), (entropy - ref_entropy).abs().max(),
                                   (shard.grad - ref_grad).abs().max()]).detach())

    here = ((targets >= rank * SHARD) & (targets < (rank + 1) * SHARD)).sum().double()
    stats = torch.cat([torch.stack(errors).amax(0), -here[None]])
    dist.all_reduce(stats, op=dist.ReduceOp.MAX, group=group)
    if rank == 0:
        print(json.dumps({"tp": tp, "logprob_err": stats[0].item(), "entropy_err": stats[1].item(),
                          "grad_err": stats[2].item(), "fewest_targets_on_a_shard": -stats[3].item(),
                          "grad_norm": ref_logits.grad.norm().item()}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
