"""The check that a run distilled as algos/distill.py defines it, shared by the tests of each mode
that add a teacher to a run (tests/workers/trained_batches.py saves its trained batches)."""

import json
import math
import os
from dataclasses import replace
from typing import List

import pytest
import torch

from megarl.planning.config import AlgoConfig
from megarl.planning.typed_config import build
from megarl.teacher.config import DistillConfig
from megarl.trainer.loop import with_advantages

WORKER = "tests/workers/trained_batches.py"


def teacher_args(teacher_dir, coeff: float) -> tuple:
    return (f"teacher.hf_dir={teacher_dir}", f"algo.distill.coeff={coeff}")


def perturbed_teacher(model_dir, out, scale: float = 0.2, seed: int = 0):
    """Another model with `model_dir`'s architecture and tokenizer: each of its weights times
    (1 + scale * N(0, 1)) elementwise, seeded; the folder's other files copied. A teacher that
    disagrees with the student from the first step, where tests have no other model of its
    tokenizer."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(model_dir, out)
    g = torch.Generator().manual_seed(seed)
    for name in os.listdir(out):
        if name.endswith(".safetensors"):
            path = os.path.join(out, name)
            weights = load_file(path)
            save_file({k: (w.float() * (1 + scale * torch.randn(w.shape, generator=g))).to(w.dtype)
                       for k, w in weights.items()}, path, metadata={"format": "pt"})
    return out


def trained_batches(folder) -> dict:
    """{step: the RolloutBatch the actor trained on} the worker saved."""
    return {int(name[5:-3]): torch.load(os.path.join(folder, name), weights_only=False)
            for name in os.listdir(folder) if name.startswith("step_")}


def check_distilled(run_dir, batches_dir, steps: List[dict], holes: bool = False) -> dict:
    """Every step's advantages are the reward's (advantage_step without a teacher, on the same
    batch) plus -coeff * (old log-prob - teacher log-prob) on the model's own tokens, in float64
    here; tokens out of the loss (inserted text) keep the reward's advantage exactly, though the
    teacher scored them; the logged distill/* metrics are the means over the model's tokens.
    `holes`: the masks must have holes (multi-turn) where the teacher's log-probs are not 0.
    Returns {step: the batch}."""
    with open(os.path.join(run_dir, "config.json")) as f:
        saved = json.load(f)
    algo = build(AlgoConfig, saved["algo"])
    coeff, max_new = algo.distill.coeff, saved["generation"]["max_new_tokens"]
    assert coeff > 0
    batches = trained_batches(batches_dir)
    logged = {s["step"]: s for s in steps if "reward/mean" in s}
    assert sorted(batches) == sorted(logged), (sorted(batches), sorted(logged))
    for number, batch in batches.items():
        keep = batch.loss_mask.bool()
        reward_part = with_advantages(batch.with_fields(teacher_logprobs=None),
                                      replace(algo, distill=DistillConfig()), max_new).advantages
        student, teacher = batch.old_logprobs.double(), batch.teacher_logprobs.double()
        term = torch.where(keep, -coeff * (student - teacher), 0.0)
        torch.testing.assert_close(batch.advantages.double(), reward_part.double() + term, rtol=0, atol=1e-5)
        assert torch.equal(batch.advantages[~keep], reward_part[~keep])
        if holes:
            inserted = ~keep & (torch.arange(batch.width)[None, :] < batch.lengths[:, None] - 1)
            inserted &= torch.cumsum(keep, 1) > 0  # after the first generated token: between turns
            assert inserted.any() and (batch.teacher_logprobs[inserted] != 0).any()
        row, n = logged[number], keep.sum()
        reverse_kl = float((student - teacher)[keep].sum() / n)
        assert row["distill/reverse_kl"] == pytest.approx(reverse_kl, abs=1e-6)
        assert row["distill/teacher_logprob"] == pytest.approx(float(teacher[keep].sum() / n), abs=1e-6)
        top1 = float(batch.teacher_top1[keep].double().mean())
        assert row["distill/teacher_top1_match"] == pytest.approx(top1, abs=1e-9)
        assert all(math.isfinite(row[k]) for k in row if k.startswith("distill/"))
        assert 0 <= row["distill/teacher_top1_match"] <= 1 and row["distill/teacher_logprob"] < 0
    return batches


def assert_teacher_is_the_start(steps: List[dict]) -> None:
    """A run whose teacher is its own starting checkpoint: the same log-probs (0.0 exactly in every
    run so far) at every step before the actor's first update with a gradient (the advantages, and
    so the gradient, are 0 while no group's rewards differ and the term is 0), and apart after one."""
    steps = [s for s in steps if "reward/mean" in s]
    untrained = [s for i, s in enumerate(steps) if all(p["actor/grad_norm"] == 0 for p in steps[:i])]
    assert untrained and all(abs(s["distill/reverse_kl"]) < 1e-6 for s in untrained), steps
    assert len(untrained) == len(steps) or abs(steps[-1]["distill/reverse_kl"]) > 1e-6, steps
