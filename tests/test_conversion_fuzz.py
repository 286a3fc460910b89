"""HF -> Megatron -> HF round trips over random small configs (family, heads, GQA ratio, head
size, vocabulary size, layers, experts and top-k, tied or untied embeddings), one and two ranks:
bit-exact every time. The draw is seeded, so a failure names a case that reproduces;
MEGARL_FUZZ_CASES=N widens the sweep beyond the CI default."""

import os
import random

import pytest

from tests.launch import load_script, run

CASES = int(os.environ.get("MEGARL_FUZZ_CASES", "6"))


def random_config(seed: int):
    rng = random.Random(seed)
    family = rng.choice(["llama", "qwen2", "qwen3", "qwen3_moe", "mixtral"])
    heads = rng.choice([2, 4, 8])
    head_dim = rng.choice([16, 32, 64])
    fields = dict(num_attention_heads=heads, num_key_value_heads=rng.choice([d for d in (1, 2, 4, 8)
                                                                            if heads % d == 0]),
                  head_dim=head_dim, hidden_size=heads * head_dim,  # vLLM's Qwen2 ignores head_dim
                  vocab_size=rng.randint(40, 700), num_hidden_layers=rng.choice([1, 2, 3, 4]),
                  intermediate_size=8 * rng.randint(4, 40),
                  tie_word_embeddings=rng.random() < 0.5)
    if family in ("qwen3_moe", "mixtral"):
        experts = rng.choice([2, 4, 8])
        renormalized = family == "mixtral" or rng.random() < 0.5
        if family == "qwen3_moe":
            fields.update(num_experts=experts, moe_intermediate_size=8 * rng.randint(2, 16),
                          norm_topk_prob=renormalized)
        else:
            fields.update(num_local_experts=experts)
        # Renormalized top-1 is refused (tests/test_hf_config.py).
        fields["num_experts_per_tok"] = rng.randint(2 if renormalized else 1, experts)
    nproc = 2 if fields["num_hidden_layers"] % 2 == 0 and rng.random() < 0.5 else 1
    return family, fields, nproc


@pytest.mark.parametrize("seed", range(CASES))
def test_random_config_round_trip_is_bit_exact(seed, tmp_path):
    from megarl.demo.tiny_checkpoint import make_tiny_checkpoint

    family, fields, nproc = random_config(seed)
    hf = make_tiny_checkpoint(family, str(tmp_path / "hf"), seed=seed, **fields)
    run("scripts/convert_hf_to_megatron.py", "--hf-dir", hf, "--out", str(tmp_path / "megatron"),
        nproc=nproc)
    run("scripts/convert_megatron_to_hf.py", "--megatron-dir", str(tmp_path / "megatron"),
        "--out", str(tmp_path / "back"), nproc=3 - nproc if fields["num_hidden_layers"] % 2 == 0 else 1)
    # scripts/compare_hf_checkpoints.py's comparison, in this process (its launch: a fifth of a case)
    result = load_script("compare_hf_checkpoints").compare(hf, str(tmp_path / "back"))
    assert result["bit_exact"], (family, fields, result)
