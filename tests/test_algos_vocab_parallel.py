"""Vocab-parallel log-probs and entropy against torch.log_softmax on the full logits, with
padded vocabulary columns: in process without a group (tp=1) and over a real 2-rank gloo group."""

import torch

from megarl.algos.vocab_parallel import logprobs_and_entropy
from tests.launch import last_json, run


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:  # [..., V] -> [...]
    """The reference: logsumexp(x) - sum(softmax(x) * x) over the full vocabulary."""
    return torch.logsumexp(logits, dim=-1) - (torch.softmax(logits, dim=-1) * logits).sum(-1)


def test_unsharded_matches_log_softmax_with_padding_masked():
    g = torch.Generator().manual_seed(0)
    vocab = 11
    logits = torch.randn(3, 5, 16, generator=g, dtype=torch.float64) * 5  # [B, T, V]: any leading dims
    logits[..., vocab:] = 50.0
    targets = torch.randint(0, vocab, (3, 5), generator=g)
    ours = logits.clone().requires_grad_()
    lp, entropy = logprobs_and_entropy(ours, targets, None, vocab_size=vocab)
    ref = logits.clone().requires_grad_()
    ref_lp = torch.log_softmax(ref[..., :vocab], -1).gather(-1, targets[..., None]).squeeze(-1)
    ref_entropy = entropy_from_logits(ref[..., :vocab])
    torch.testing.assert_close(lp, ref_lp, rtol=0, atol=1e-12)
    torch.testing.assert_close(entropy, ref_entropy, rtol=0, atol=1e-12)
    w = torch.randn(2, 3, 5, generator=g, dtype=torch.float64)
    ((w[0] * lp).sum() + (w[1] * entropy).sum()).backward()
    ((w[0] * ref_lp).sum() + (w[1] * ref_entropy).sum()).backward()
    torch.testing.assert_close(ours.grad, ref.grad, rtol=0, atol=1e-12)
    assert torch.all(ours.grad[..., vocab:] == 0) and ours.grad.abs().max() > 1e-3


def test_two_rank_gloo_group_matches_full_log_softmax():
    result = last_json(run("tests/workers/vocab_parallel_worker.py", nproc=2, timeout=300))
    assert result["tp"] == 2 and result["fewest_targets_on_a_shard"] > 0
    assert result["grad_norm"] > 1e-3
    for key in ("logprob_err", "entropy_err", "grad_err"):
        assert result[key] <= 1e-10, result
