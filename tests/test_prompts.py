"""Prompt data with the demo's real sentencepiece tokenizer: JSONL and Parquet, chat template,
length filtering, and a seeded sampler that resumes exactly."""

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import transformers

from megarl.rollout.arithmetic_task import arithmetic_records, train_tokenizer, write_jsonl
from megarl.rollout.prompts import PromptSampler, load_prompts
from megarl.rollout.rewards import math_verify


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    root = tmp_path_factory.mktemp("task")
    records = arithmetic_records(200, 20, seed=0)
    train_tokenizer(records, str(root / "tokenizer"))
    write_jsonl(records, str(root / "train.jsonl"))
    return root, records, transformers.AutoTokenizer.from_pretrained(str(root / "tokenizer"))


def test_tokenizer_spells_digits_and_round_trips(task):
    _, _, tokenizer = task
    text = "What is 12 + 7? Answer: 19"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text
    assert [tokenizer.decode([i]).strip() for i in tokenizer.encode("19", add_special_tokens=False)
            if tokenizer.decode([i]).strip()] == ["1", "9"]
    assert len(tokenizer) == 48 and tokenizer.eos_token_id is not None


def test_jsonl_and_parquet_with_chat_template_and_length_filter(task):
    root, records, tokenizer = task
    chats = [{"messages": [{"role": "user", "content": r["prompt"]}], "answer": r["answer"]}
             for r in records]
    pq.write_table(pa.Table.from_pylist(chats), str(root / "train.parquet"))
    from_jsonl = load_prompts(str(root / "train.jsonl"), tokenizer, max_prompt_len=64)
    from_parquet = load_prompts(str(root / "train.parquet"), tokenizer, max_prompt_len=64)
    assert from_jsonl.prompts == from_parquet.prompts and from_jsonl.dropped_too_long == 0
    first = from_jsonl.prompts[0]
    assert first.text == records[0]["prompt"] + " Answer:" and first.answer == records[0]["answer"]
    assert math_verify(f"{first.text} {first.answer}", first.answer) == 1.0
    lengths = sorted(len(p.token_ids) for p in from_jsonl.prompts)
    cut = lengths[len(lengths) // 2]
    short = load_prompts(str(root / "train.jsonl"), tokenizer, max_prompt_len=cut)
    assert len(short.prompts) == sum(n <= cut for n in lengths)
    assert short.dropped_too_long == sum(n > cut for n in lengths) > 0
    with pytest.raises(ValueError, match="no 'label' field"):
        load_prompts(str(root / "train.jsonl"), tokenizer, 64, answer_key="label")


def test_sampler_is_seeded_and_resumes_exactly():
    straight = PromptSampler(10, 4, seed=3)
    batches = [straight.next_batch() for _ in range(6)]
    assert all(len(b) == 4 for b in batches)
    assert sorted(batches[0] + batches[1]) == sorted(set(batches[0] + batches[1]))  # no repeats in an epoch
    resumed = PromptSampler(10, 4, seed=3)
    for _ in range(3):
        resumed.next_batch()
    state = resumed.state_dict()
    fresh = PromptSampler(10, 4, seed=3)
    fresh.load_state_dict(state)
    assert [fresh.next_batch() for _ in range(3)] == batches[3:]
    assert PromptSampler(10, 4, seed=4).next_batch() != batches[0]
    with pytest.raises(ValueError, match="seed 3, this run uses 5"):
        PromptSampler(10, 4, seed=5).load_state_dict(state)
