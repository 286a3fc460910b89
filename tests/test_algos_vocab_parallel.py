"""Vocab-parallel log-probs and entropy against torch.log_softmax on the full logits, with
padded vocabulary columns, whole and in chunks of tokens: in process without a group (tp=1) and
over a real 2-rank gloo group; bf16 logits computed in fp32 with a bf16 gradient."""

import pytest
import torch

from megarl.algos.vocab_parallel import logprobs_and_entropy
from tests.launch import last_json, run


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:  # [..., V] -> [...]
    """The reference: logsumexp(x) - sum(softmax(x) * x) over the full vocabulary."""
    return torch.logsumexp(logits, dim=-1) - (torch.softmax(logits, dim=-1) * logits).sum(-1)


@pytest.mark.parametrize("chunk_tokens", [1, 4, 15, 1024])
def test_unsharded_matches_log_softmax_with_padding_masked(chunk_tokens):
    g = torch.Generator().manual_seed(0)
    vocab = 11
    logits = torch.randn(3, 5, 16, generator=g, dtype=torch.float64) * 5  # [B, T, V]: any leading dims
    logits[..., vocab:] = 50.0
    targets = torch.randint(0, vocab, (3, 5), generator=g)
    ours = logits.clone().requires_grad_()
    lp, entropy = logprobs_and_entropy(ours, targets, None, vocab_size=vocab, chunk_tokens=chunk_tokens)
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


def test_bf16_logits_are_computed_in_fp32_with_a_bf16_gradient():
    """The actor passes the model's bf16 logits as they are: the result is the fp32 computation on
    the same values (not a bf16 softmax), and the gradient is the fp32 one rounded to bf16."""
    g = torch.Generator().manual_seed(1)
    logits = (torch.randn(37, 96, generator=g) * 4).to(torch.bfloat16)
    targets = torch.randint(0, 96, (37,), generator=g)
    w = torch.randn(2, 37, generator=g)
    ours = logits.clone().requires_grad_()
    lp, entropy = logprobs_and_entropy(ours, targets, None, chunk_tokens=8)
    assert lp.dtype == entropy.dtype == torch.float32 and ours.grad is None
    ((w[0] * lp).sum() + (w[1] * entropy).sum()).backward()
    ref = logits.double().requires_grad_()
    ref_lp = torch.log_softmax(ref, -1).gather(-1, targets[:, None]).squeeze(-1)
    ref_entropy = entropy_from_logits(ref)
    ((w[0] * ref_lp).sum() + (w[1] * ref_entropy).sum()).backward()
    torch.testing.assert_close(lp.double(), ref_lp.detach(), rtol=0, atol=1e-5)
    torch.testing.assert_close(entropy.double(), ref_entropy.detach(), rtol=0, atol=1e-5)
    assert ours.grad.dtype == torch.bfloat16
    torch.testing.assert_close(ours.grad, ref.grad.to(torch.bfloat16), rtol=1e-2, atol=1e-3)


def test_chunk_tokens_is_checked():
    with pytest.raises(ValueError, match="chunk_tokens=0 must be >= 1"):
        logprobs_and_entropy(torch.zeros(2, 3), torch.zeros(2, dtype=torch.long), None, chunk_tokens=0)


def test_two_rank_gloo_group_matches_full_log_softmax():
    result = last_json(run("tests/workers/vocab_parallel_worker.py", nproc=2, timeout=300))
    assert result["tp"] == 2 and result["fewest_targets_on_a_shard"] > 0
    assert result["grad_norm"] > 1e-3
    for key in ("logprob_err", "entropy_err", "grad_err"):
        assert result[key] <= 1e-10, result
