"""A NaN/inf loss or gradient skips the update on every rank: weights, Adam moments and the LR
schedule stay bit for bit as they were (so nothing non-finite can reach a checkpoint), the skip
is reported in the update's metrics, and the next finite update trains normally. At DP2 the bad
row lands on one data-parallel rank only, so the ranks must agree to skip together."""

import json

import pytest
import torch

from tests.launch import run


@pytest.fixture(scope="module")
def history(megatron_models, tmp_path_factory):
    out = tmp_path_factory.mktemp("nonfinite") / "history.pt"
    run("tests/workers/nonfinite_update.py", "--layout", json.dumps({}), "--megatron-dir",
        megatron_models["qwen3"], "--out", str(out), nproc=2, timeout=900)
    return torch.load(out)


def _same(a, b):
    return all(torch.equal(a["weights"][k], b["weights"][k]) for k in a["weights"]) and \
        len(a["moments"]) == len(b["moments"]) and all(map(torch.equal, a["moments"], b["moments"]))


@pytest.mark.parametrize("role", ["actor", "critic"])
def test_nonfinite_update_is_skipped_and_training_goes_on(history, role):
    first, poisoned, after = history[role]
    assert first["metrics"]["skipped"] == 0.0 and first["scheduler_steps"] == 1
    assert poisoned["metrics"]["skipped"] == 1.0
    assert poisoned["metrics"]["grad_norm"] != poisoned["metrics"]["grad_norm"]  # nan
    assert _same(poisoned, first) and poisoned["scheduler_steps"] == 1
    assert all(torch.isfinite(w).all() for w in poisoned["weights"].values())
    assert after["metrics"]["skipped"] == 0.0 and after["scheduler_steps"] == 2
    assert not _same(after, poisoned)
