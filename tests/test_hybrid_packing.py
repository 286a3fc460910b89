"""A Gated DeltaNet hybrid (tiny Qwen3-Next) on a thd pack of sequences of different lengths: each
sequence's log-probs equal the same sequence run alone (the conv and the recurrent state restart at
every boundary) and HF transformers' on it; at TP2, so the heads and the conv's channels are split."""

import torch

from tests.launch import run


def test_a_pack_of_different_lengths_equals_each_sequence_alone(hf_models, tmp_path):
    out = tmp_path / "packed.pt"
    run("tests/workers/packed_hybrid.py", "--hf-dir", hf_models["qwen3_next"], "--out", str(out), nproc=2)
    got = torch.load(out)
    for i, n in enumerate(got["lengths"]):
        packed = got["packed"][i, :n]
        assert float((packed - got["alone"][i]).abs().max()) <= 2e-5, (n, packed, got["alone"][i])
        assert float((packed - got["hf"][i]).abs().max()) <= 1e-4, (n, packed, got["hf"][i])
        assert not got["packed"][i, n:].any()  # nothing scored past a sequence's end
