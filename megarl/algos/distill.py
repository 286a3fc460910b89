"""On-policy distillation's per-token term and its metrics: pure functions of tensors and floats.

The student samples; the teacher gives each sampled token its log-prob; each response token's
advantage gains -coeff * (log pi_student(y_t) - log pi_teacher(y_t)), the single-sample estimate
of the reverse KL at that token, with no discounting across tokens (the reverse-KL recipe of
Agarwal et al. 2024 and Thinking Machines' "On-Policy Distillation", as slime and NeMo-RL run it).
It is added after the estimator's advantages (and their whitening), so a reward's advantages and
the teacher's dense signal add; with algo.reward none the estimator's part is zero.

Does not own where the log-probs come from (megarl/teacher) nor the policy loss that reads the
advantages (policy_losses.py).
"""

from typing import Dict

import torch


def reverse_kl(student_logprobs: torch.Tensor,  # [B, T] log pi_student of the sampled tokens
               teacher_logprobs: torch.Tensor  # [B, T] log pi_teacher of the same tokens
               ) -> torch.Tensor:  # [B, T]
    """Per-token reverse KL estimate log pi_student - log pi_teacher (k1: unbiased under the
    student's own samples)."""
    return student_logprobs - teacher_logprobs


def distill_advantages(advantages: torch.Tensor,  # [B, T] the estimator's
                       student_logprobs: torch.Tensor,  # [B, T]
                       teacher_logprobs: torch.Tensor,  # [B, T]
                       mask: torch.Tensor,  # [B, T] 1 on the model's own tokens
                       coeff: float) -> torch.Tensor:  # [B, T]
    """The advantages plus -coeff * reverse KL on masked-in tokens; prompt, tool-output and padding
    tokens get no term (their log-probs may hold anything)."""
    term = -coeff * reverse_kl(student_logprobs, teacher_logprobs)
    return advantages + torch.where(mask.bool(), term, torch.zeros((), dtype=term.dtype)).to(advantages.dtype)


def distill_metrics(student_logprobs: torch.Tensor,  # [B, T]
                    teacher_logprobs: torch.Tensor,  # [B, T]
                    teacher_top1: torch.Tensor,  # [B, T] 1 where the teacher's most likely token was sampled
                    mask: torch.Tensor  # [B, T]
                    ) -> Dict[str, torch.Tensor]:
    """Means over the masked-in tokens: the reverse KL, the teacher's log-prob of the sample, and
    how often the sample is the teacher's top-1 token (0-dim tensors; 0 without tokens)."""
    keep = mask.bool()
    count = keep.sum().clamp(min=1)

    def mean(values: torch.Tensor) -> torch.Tensor:
        return torch.where(keep, values.double(), 0.0).sum() / count

    return {"distill/reverse_kl": mean(reverse_kl(student_logprobs, teacher_logprobs)),
            "distill/teacher_logprob": mean(teacher_logprobs),
            "distill/teacher_top1_match": mean(teacher_top1)}
