"""Prompt data with the demo's real sentencepiece tokenizer: JSONL and Parquet, chat template,
length filtering (skip or refuse), bad records and truncated files refused naming where, and a
seeded sampler that resumes exactly."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import transformers

from megarl.demo.arithmetic_task import arithmetic_records, train_tokenizer, write_jsonl
from megarl.rewards.builtin import math_reward
from megarl.rollout.prompts import PromptSampler, RecordKeys, load_prompts


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
    assert math_reward(f"{first.text} {first.answer}", first.answer) == 1.0
    lengths = sorted(len(p.token_ids) for p in from_jsonl.prompts)
    cut = lengths[len(lengths) // 2]
    short = load_prompts(str(root / "train.jsonl"), tokenizer, max_prompt_len=cut)
    assert len(short.prompts) == sum(n <= cut for n in lengths)
    assert short.dropped_too_long == sum(n > cut for n in lengths) > 0
    with pytest.raises(ValueError, match="no 'label' field"):
        load_prompts(str(root / "train.jsonl"), tokenizer, 64, RecordKeys(answer="label"))


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


def _jsonl(path, records, tail: str = ""):
    path.write_text("".join(json.dumps(r) + "\n" for r in records) + tail)
    return str(path)


@pytest.mark.parametrize("bad,message", [
    ({"prompt": "", "answer": "1"}, r"record 2: 'prompt' is '', not a non-empty string"),
    ({"prompt": "   ", "answer": "1"}, r"record 2: 'prompt' is '   '"),
    ({"question": "1 + 1", "answer": "2"}, r"record 2: 'prompt' is None.*data.prompt_key"),
    ({"messages": [], "answer": "1"}, r"record 2: 'messages' holds no text"),
    ({"prompt": "1 + 1"}, r"record 2 has no 'answer' field \(keys \['prompt'\]\); set data.answer_key"),
])
def test_bad_records_are_refused_naming_the_record(task, tmp_path, bad, message):
    _, records, tokenizer = task
    path = _jsonl(tmp_path / "bad.jsonl", [*records[:2], bad, *records[2:5]])
    with pytest.raises(ValueError, match=message):
        load_prompts(path, tokenizer, 64)


def test_overlong_prompts_are_skipped_and_counted_or_refused(task, tmp_path):
    _, records, tokenizer = task
    long = {"prompt": " ".join(["12 + 34"] * 40), "answer": "46"}
    path = _jsonl(tmp_path / "long.jsonl", [records[0], long, records[1], long])
    skipped = load_prompts(path, tokenizer, 64)
    assert [p.answer for p in skipped.prompts] == [records[0]["answer"], records[1]["answer"]]
    assert skipped.dropped_too_long == 2
    with pytest.raises(ValueError, match=r"record 1 is \d+ tokens, over data.max_prompt_len=64; raise "
                                         r"data.max_prompt_len or set data.overlong_prompts=skip"):
        load_prompts(path, tokenizer, 64, overlong="error")
    with pytest.raises(ValueError, match=r"all 2 are longer"):
        load_prompts(_jsonl(tmp_path / "only_long.jsonl", [long, long]), tokenizer, 64)


def test_truncated_and_empty_files_are_refused(task, tmp_path):
    root, records, tokenizer = task
    cut = _jsonl(tmp_path / "cut.jsonl", records[:3], tail='{"prompt": "What is 1')
    with pytest.raises(ValueError, match=r"cut.jsonl line 4 is not valid JSON .*truncated"):
        load_prompts(cut, tokenizer, 64)
    with pytest.raises(ValueError, match=r"line 1 is a JSON list"):
        load_prompts(_jsonl(tmp_path / "list.jsonl", [[1, 2]]), tokenizer, 64)
    with pytest.raises(ValueError, match=r"holds no records"):
        load_prompts(_jsonl(tmp_path / "empty.jsonl", []), tokenizer, 64)
    whole = tmp_path / "whole.parquet"
    pq.write_table(pa.Table.from_pylist(records), str(whole))
    data = whole.read_bytes()
    (tmp_path / "cut.parquet").write_bytes(data[:len(data) // 2])
    with pytest.raises(ValueError, match=r"cut.parquet is not a readable Parquet file .*truncated"):
        load_prompts(str(tmp_path / "cut.parquet"), tokenizer, 64)
    with pytest.raises(FileNotFoundError, match=r"missing.jsonl' does not exist"):
        load_prompts(str(tmp_path / "missing.jsonl"), tokenizer, 64)


def _verl_gsm8k(question: str, answer: str, index: int) -> dict:
    """A record as verl's examples/data_preprocess/gsm8k.py writes it."""
    instruction = 'Let\'s think step by step and output the final answer after "####".'
    return {"data_source": "openai/gsm8k",
            "prompt": [{"role": "user", "content": f"{question} {instruction}"}],
            "ability": "math", "reward_model": {"style": "rule", "ground_truth": answer},
            "extra_info": {"split": "train", "index": index, "answer": f"so\n#### {answer}",
                           "question": question}}


def test_verl_parquet_is_read_as_is(task, tmp_path):
    _, records, tokenizer = task
    verl = [_verl_gsm8k(r["prompt"], r["answer"], i) for i, r in enumerate(records[:6])]
    pq.write_table(pa.Table.from_pylist(verl), str(tmp_path / "train.parquet"))
    prompts = load_prompts(str(tmp_path / "train.parquet"), tokenizer, 64).prompts
    for prompt, record in zip(prompts, verl):
        assert prompt.text == tokenizer.apply_chat_template(record["prompt"], tokenize=False,
                                                            add_generation_prompt=True)
        assert prompt.answer == record["reward_model"]["ground_truth"]
        assert prompt.data_source == "openai/gsm8k" and prompt.extra_info == record["extra_info"]


@pytest.mark.parametrize("layout,keys", [
    # slime: --input-key prompt --label-key label --metadata-key metadata, chat in the input
    (lambda r: {"prompt": [{"role": "user", "content": r["prompt"]}], "label": r["answer"],
                "metadata": {"id": 1}}, RecordKeys(answer="label", extra_info="metadata")),
    # slime with text input and its default keys
    (lambda r: {"input": r["prompt"], "label": r["answer"], "metadata": {"id": 1}},
     RecordKeys(prompt="input", answer="label", extra_info="metadata")),
    # NeMo-RL: messages, task_name and a ground truth
    (lambda r: {"messages": [{"role": "user", "content": r["prompt"]}], "task_name": "math",
                "extra_env_info": {"ground_truth": r["answer"]}},
     RecordKeys(answer="extra_env_info.ground_truth", data_source="task_name")),
    # NeMo-RL's ResponseDataset jsonl: input and output
    (lambda r: {"input": r["prompt"], "output": r["answer"]}, RecordKeys(prompt="input", answer="output")),
])
def test_other_layouts_by_key_paths(task, tmp_path, layout, keys):
    _, records, tokenizer = task
    path = _jsonl(tmp_path / "other.jsonl", [layout(r) for r in records[:4]])
    prompts = load_prompts(path, tokenizer, 64, keys).prompts
    assert [p.answer for p in prompts] == [r["answer"] for r in records[:4]]
    # Text and one-message chats render alike (a text prompt becomes the user turn).
    assert prompts[0].text == tokenizer.apply_chat_template(
        [{"role": "user", "content": records[0]["prompt"]}], tokenize=False, add_generation_prompt=True)
    assert prompts[0].data_source == ("math" if keys.data_source == "task_name" else "")
    assert prompts[0].extra_info == ({"id": 1} if keys.extra_info == "metadata" else {})


@pytest.mark.parametrize("bad,message", [
    ({"prompt": [{"role": "user", "content": "1 + 1"}, {"role": "assistant", "content": "2"}],
      "answer": "2"}, r"record 2: 'prompt' ends with an assistant turn \('2'\)"),
    ({"prompt": [{"content": "1 + 1"}], "answer": "2"}, r"record 2: 'prompt' holds \{'content': '1 \+ 1'\}, "
                                                        r"not a chat message"),
    ({"prompt": "1 + 1", "answer": "2", "extra_info": "x"}, r"record 2: 'extra_info' is 'x', not a mapping"),
])
def test_bad_chats_and_fields_are_refused(task, tmp_path, bad, message):
    _, records, tokenizer = task
    with pytest.raises(ValueError, match=message):
        load_prompts(_jsonl(tmp_path / "bad.jsonl", [*records[:2], bad]), tokenizer, 64)


def test_no_known_ground_truth_names_the_keys(task, tmp_path):
    _, _, tokenizer = task
    path = _jsonl(tmp_path / "nolabel.jsonl", [{"prompt": "1 + 1", "solution": "2"}])
    with pytest.raises(ValueError, match=r"record 0 has none of the ground-truth fields \['answer', "
                                         r"'reward_model.ground_truth'\].*set data.answer_key"):
        load_prompts(path, tokenizer, 64)
    nested = _jsonl(tmp_path / "nested.jsonl", [{"prompt": "1 + 1", "meta": {"solution": 2}}])
    assert load_prompts(nested, tokenizer, 64, RecordKeys(answer="meta.solution")).prompts[0].answer == 2
