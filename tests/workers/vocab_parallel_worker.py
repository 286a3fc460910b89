"""torchrun worker: vocab-parallel log-probs and entropy at TP = world size over a gloo group, and
at TP1 (no group) on every rank, with each of the head's kernels (eager, compiled: Inductor's CPU
code of the GPU's kernels), against torch.log_softmax on the full logits in fp64. fp64 logits, in
chunks of 1 and 5 tokens (a last chunk shorter than the rest) and whole; a vocabulary whose
padding leaves the last shard a few real columns, and one that leaves it none; with and without the
entropy's gradient. bf16 logits against the fp64 reference's gradient rounded to bf16. Each rank
compares its own shard's gradient; rank 0 prints one JSON object with the worst errors over all
ranks and cases, per kernel. Also the teacher's top-1 match from the shards against torch.argmax
on the full logits' real columns (fp64 and bf16), half the targets the argmax: how many disagree
and how many match."""

import json

import torch
import torch.distributed as dist

from megarl.algos.vocab_parallel import KERNELS, logprobs_and_entropy, top1_match

N, SHARD = 24, 8  # padded vocab = SHARD * tp; ids >= the vocabulary are output-layer padding
VOCABS = (13, 6)  # at tp 2: the last shard holds 5 real columns, then none


def reference(full: torch.Tensor, targets, weights, vocab: int, entropy_grad: bool):
    """(log-probs, entropy, gradient) of the weighted loss, autograd through a full log-softmax."""
    logits = full.double().clone().requires_grad_()
    logp = torch.log_softmax(logits[:, :vocab], dim=-1)
    lp = logp.gather(-1, targets[:, None]).squeeze(-1)
    entropy = -(logp.exp() * logp).sum(-1)
    ((weights[0] * lp).sum() + ((weights[1] * entropy).sum() if entropy_grad else 0)).backward()
    return lp.detach(), entropy.detach(), logits.grad


def errors(full, targets, weights, vocab, group, kernels, chunk_tokens, entropy_grad, dtype):
    """Max |ours - reference| of (log-probs, entropy, this rank's gradient)."""
    tp = 1 if group is None else dist.get_world_size(group)
    rank = 0 if group is None else dist.get_rank(group)
    width = full.shape[1] // tp
    ref_lp, ref_entropy, ref_grad = reference(full.to(dtype), targets, weights, vocab, entropy_grad)
    shard = full[:, rank * width:(rank + 1) * width].to(dtype).clone().requires_grad_()
    lp, entropy = logprobs_and_entropy(shard, targets, group, vocab_size=vocab, chunk_tokens=chunk_tokens,
                                       kernels=kernels, entropy_grad=entropy_grad)
    assert entropy.requires_grad == entropy_grad
    ((weights[0] * lp).sum() + ((weights[1] * entropy).sum() if entropy_grad else 0)).backward()
    expected = ref_grad[:, rank * width:(rank + 1) * width].to(dtype)  # fp64, or rounded to bf16
    assert shard.grad.dtype == dtype
    return [(lp.double() - ref_lp).abs().max().item(), (entropy.double() - ref_entropy).abs().max().item(),
            (shard.grad.double() - expected.double()).abs().max().item()]


def top1_counts(full, targets, vocab, group, dtype):
    """(targets where the shards' top-1 match disagrees with the full argmax, targets that match).
    A target tied with the argmax (bf16 rounding) is a match too."""
    tp, rank = dist.get_world_size(group), dist.get_rank(group)
    width = full.shape[1] // tp
    logits = full.to(dtype)
    real = logits[:, :vocab].float()
    tied = real.gather(-1, targets[:, None]).squeeze(-1) == real.amax(-1)
    expected = (real.argmax(-1) == targets) | tied
    got = top1_match(logits[:, rank * width:(rank + 1) * width], targets, group, vocab)
    return int((got != expected).sum()), int(got.sum())


def main():
    dist.init_process_group("gloo")
    rank, tp = dist.get_rank(), dist.get_world_size()
    group = dist.new_group(list(range(tp)), backend="gloo")
    g = torch.Generator().manual_seed(0)
    full = torch.randn(N, SHARD * tp, generator=g, dtype=torch.float64) * 6
    weights = torch.randn(2, N, generator=g, dtype=torch.float64)
    worst, top1 = {}, {"wrong": 0, "matched": 0}
    for vocab in VOCABS:
        logits = full.clone()
        logits[:, vocab:] = 60.0  # would dominate the softmax and the max shift if not masked
        targets = torch.arange(N) * 5 % vocab  # ids on every shard that holds real columns
        argmax = logits[:, :vocab].argmax(-1)
        for dtype in (torch.float64, torch.bfloat16):
            wrong, matched = top1_counts(logits, torch.where(torch.arange(N) % 2 == 0, argmax, targets),
                                         vocab, group, dtype)
            top1["wrong"] += wrong
            top1["matched"] += matched
        for name in KERNELS:
            for chunk_tokens in ((N, 1, 5) if name == "eager" else (N,)):
                for entropy_grad in (True, False):
                    for layout in (group, None):
                        cases = {"fp64": errors(logits, targets, weights, vocab, layout, name, chunk_tokens,
                                                entropy_grad, torch.float64),
                                 "bf16": errors(logits, targets, weights, vocab, layout, name, chunk_tokens,
                                                entropy_grad, torch.bfloat16)}
                        for precision, errs in cases.items():
                            key = f"{name}_{precision}"
                            worst[key] = [max(a, b) for a, b in zip(worst.get(key, [0.0] * 3), errs)]
    keys = sorted(worst)
    stats = torch.tensor([worst[k] for k in keys], dtype=torch.float64)
    dist.all_reduce(stats, op=dist.ReduceOp.MAX, group=group)
    first = torch.arange(N) * 5 % VOCABS[0]
    here = ((first >= rank * SHARD) & (first < (rank + 1) * SHARD)).sum().double()
    dist.all_reduce(here, op=dist.ReduceOp.MIN, group=group)
    if rank == 0:
        print(json.dumps({"tp": tp, "vocabs": VOCABS, "fewest_targets_on_a_shard": here.item(),
                          "top1_wrong": top1["wrong"], "top1_matched": top1["matched"],
                          **{k: dict(zip(("logprob_err", "entropy_err", "grad_err"), row.tolist()))
                             for k, row in zip(keys, stats)}}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
