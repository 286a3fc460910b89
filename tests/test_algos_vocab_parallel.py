"""Vocab-parallel log-probs and entropy against torch.log_softmax on the full logits, with
padded vocabulary columns, whole and in chunks of tokens: in process without a group (tp=1) and
over a real 2-rank gloo group, with each of the head's kernels (the compiled one, the GPU's, built by
Inductor for the CPU); bf16 logits computed in fp32 with a bf16 gradient; the entropy's gradient
left out when the loss has no entropy term."""

import pytest
import torch

from megarl.algos.vocab_parallel import COMPILED, EAGER, EAGER_MIN_CHUNKS, kernels_for, logprobs_and_entropy
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


def test_without_entropy_grad_the_gradient_is_the_logprobs_alone():
    """entropy_grad=False: the entropy is still returned (a metric), without a gradient, and the
    logits' gradient is exactly d(sum w log p)/dx."""
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(9, 20, generator=g, dtype=torch.float64) * 3
    targets = torch.randint(0, 20, (9,), generator=g)
    w = torch.randn(9, generator=g, dtype=torch.float64)
    ours = logits.clone().requires_grad_()
    lp, entropy = logprobs_and_entropy(ours, targets, None, chunk_tokens=4, entropy_grad=False)
    assert not entropy.requires_grad
    (w * lp).sum().backward()
    ref = logits.clone().requires_grad_()
    (w * torch.log_softmax(ref, -1).gather(-1, targets[:, None]).squeeze(-1)).sum().backward()
    torch.testing.assert_close(ours.grad, ref.grad, rtol=0, atol=1e-12)
    torch.testing.assert_close(entropy, entropy_from_logits(logits), rtol=0, atol=1e-12)


def test_the_eager_chunks_are_a_fraction_of_the_tokens():
    """The eager kernels' fp32 temporaries are sized by the chunk: at most 1/EAGER_MIN_CHUNKS of the
    tokens (at 4K tokens 512 rows, not 1024), so the head's peak stays under the fp32 logits'."""
    assert [EAGER.chunk_rows(n, 1024) for n in (1, 7, 100, 4096, 16384, 10**6)] == [1, 1, 13, 512, 1024, 1024]
    assert EAGER.chunk_rows(4096, 1024) * EAGER_MIN_CHUNKS == 4096
    assert COMPILED.chunk_rows(16384, 1024) == 16384  # fused: no [chunk, V] temporaries, all at once
    assert kernels_for(torch.device("cuda")) is COMPILED and kernels_for(torch.device("cpu")) is EAGER


def test_arguments_are_checked():
    with pytest.raises(ValueError, match="chunk_tokens=0 must be >= 1"):
        logprobs_and_entropy(torch.zeros(2, 3), torch.zeros(2, dtype=torch.long), None, chunk_tokens=0)
    with pytest.raises(ValueError, match="kernels='triton': choose one of"):
        logprobs_and_entropy(torch.zeros(2, 3), torch.zeros(2, dtype=torch.long), None, kernels="triton")


def test_two_rank_gloo_group_matches_full_log_softmax_with_each_kernel():
    """Both kernels at TP2 and TP1, fp64 exact and bf16 to the rounding of the fp64 gradient, with
    a shard of a few real columns and a shard of padding only (tests/workers/vocab_parallel_worker.py);
and the teacher's top-1 match from the shards, which is torch.argmax on the full real columns (half
the targets are the argmax: 4 cases of 24 tokens, 12 of which match, and the others that tie)."""
    result = last_json(run("tests/workers/vocab_parallel_worker.py", nproc=2, timeout=300))
    assert result["tp"] == 2 and result["fewest_targets_on_a_shard"] > 0
    assert result["top1_wrong"] == 0 and result["top1_matched"] >= 4 * 12, result
    for kernels in ("eager", "compiled"):
        fp64, bf16 = result[f"{kernels}_fp64"], result[f"{kernels}_bf16"]
        assert max(fp64.values()) <= 1e-12, result
        # bf16: the same fp32 computation on the rounded logits; the gradient rounds to the fp64
        # one's bf16 but for a rounding step (|gradient| < 4: one bf16 step is at most 2^-6)
        assert bf16["logprob_err"] <= 1e-5 and bf16["entropy_err"] <= 1e-5, result
        assert bf16["grad_err"] <= 2 ** -6, result
