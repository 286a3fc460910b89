"""Prompts for rollouts: reading JSONL/Parquet records, rendering and tokenizing them, filtering
by length, and sampling batches in a seeded, resumable order.

A record holds either `prompt` (text) or `messages` (chat: [{"role", "content"}]) and an `answer`
(ground truth for the reward); the key names are configurable. A tokenizer with a chat template
renders both kinds as a chat with the generation prompt; without one, text is used as is.
Does not own generation or rewards.
"""

import json
import os
from dataclasses import dataclass
from typing import Dict, List

import torch


def read_records(path: str) -> List[dict]:
    """Every record of a .jsonl or .parquet file; a malformed or truncated file is refused naming
    the line (JSONL) or the file (Parquet)."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"prompt file {path!r} does not exist")
    if path.endswith(".jsonl"):
        records = []
        with open(path) as f:
            for number, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as error:
                    raise ValueError(f"{path} line {number} is not valid JSON ({error.msg}); a truncated "
                                     "or corrupted file? Fix or remove that line") from error
                if not isinstance(record, dict):
                    raise ValueError(f"{path} line {number} is a JSON {type(record).__name__}, not an "
                                     "object with the prompt and answer fields")
                records.append(record)
        return records
    if path.endswith(".parquet"):
        import pyarrow as pa
        import pyarrow.parquet as pq

        try:
            return pq.read_table(path).to_pylist()
        except (pa.ArrowException, OSError) as error:
            raise ValueError(f"{path} is not a readable Parquet file ({error}); a truncated or partial "
                             "copy? Copy or write it again") from error
    raise ValueError(f"prompt file {path!r}: use .jsonl or .parquet")


def _check_not_empty(record: dict, prompt_key: str, where: str) -> None:
    """An empty prompt would make the model answer nothing in particular: refuse, do not guess."""
    messages = record.get("messages")
    if messages is None:
        text = record.get(prompt_key)
        if not isinstance(text, str) or not text.strip():
            raise ValueError(f"{where}: {prompt_key!r} is {text!r}, not a non-empty string; remove the "
                             "record or point data.prompt_key at the prompt field")
    elif not messages or not any(str(m.get("content", "")).strip() for m in messages):
        raise ValueError(f"{where}: 'messages' holds no text ({messages!r}); remove the record")


def render(record: dict, tokenizer, prompt_key: str) -> str:
    messages = record.get("messages")
    if messages is None:
        if prompt_key not in record:
            raise ValueError(f"record has neither {prompt_key!r} nor 'messages': keys {sorted(record)}; "
                             f"set data.prompt_key to the field holding the prompt")
        messages = [{"role": "user", "content": record[prompt_key]}]
        if not getattr(tokenizer, "chat_template", None):
            return record[prompt_key]
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("chat 'messages' need a tokenizer with a chat template; this one has none")
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


@dataclass(frozen=True)
class Prompt:
    text: str
    token_ids: List[int]
    answer: str


@dataclass(frozen=True)
class PromptSet:
    prompts: List[Prompt]
    dropped_too_long: int  # records whose prompt exceeded max_prompt_len tokens


OVERLONG = ("skip", "error")


def load_prompts(path: str, tokenizer, max_prompt_len: int, prompt_key: str = "prompt",
                 answer_key: str = "answer", overlong: str = "skip") -> PromptSet:
    """The file's prompts, rendered and tokenized. A missing field or an empty prompt is an
    error naming the record; a prompt over `max_prompt_len` tokens is skipped and counted, or
    with overlong="error" refused."""
    if overlong not in OVERLONG:
        raise ValueError(f"data.overlong_prompts={overlong!r}; choose one of {OVERLONG}")
    records = read_records(path)
    if not records:
        raise ValueError(f"prompt file {path} holds no records")
    kept, dropped = [], 0
    for index, record in enumerate(records):
        where = f"{path} record {index}"
        if answer_key not in record:
            raise ValueError(f"{where} has no {answer_key!r} field (keys {sorted(record)}); "
                             "set data.answer_key")
        _check_not_empty(record, prompt_key, where)
        text = render(record, tokenizer, prompt_key)
        ids = tokenizer.encode(text, add_special_tokens=False)
        if len(ids) > max_prompt_len:
            if overlong == "error":
                raise ValueError(f"{where} is {len(ids)} tokens, over data.max_prompt_len={max_prompt_len}; "
                                 "raise data.max_prompt_len or set data.overlong_prompts=skip")
            dropped += 1
            continue
        kept.append(Prompt(text, ids, str(record[answer_key])))
    if not kept:
        raise ValueError(f"no prompt of {path} fits data.max_prompt_len={max_prompt_len} (all {dropped} "
                         "are longer); raise data.max_prompt_len")
    return PromptSet(kept, dropped)


class PromptSampler:
    """Batches of prompt indices: a fresh seeded permutation each epoch; its position is state
    (saved in checkpoints) so a resumed run draws exactly the batches it would have drawn."""

    def __init__(self, size: int, batch_size: int, seed: int):
        if not 0 < batch_size <= size:
            raise ValueError(f"prompt batch size {batch_size} must lie in [1, {size}] (the prompt count)")
        self.size, self.batch_size, self.seed = size, batch_size, seed
        self.epoch, self.position = 0, 0

    def _order(self) -> torch.Tensor:
        return torch.randperm(self.size, generator=torch.Generator().manual_seed(self.seed + self.epoch))

    def next_batch(self) -> List[int]:
        """The next batch_size indices; an epoch's last partial batch is skipped."""
        if self.position + self.batch_size > self.size:
            self.epoch, self.position = self.epoch + 1, 0
        batch = self._order()[self.position:self.position + self.batch_size].tolist()
        self.position += self.batch_size
        return batch

    def state_dict(self) -> Dict[str, int]:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed}

    def load_state_dict(self, state: Dict[str, int]) -> None:
        if state["seed"] != self.seed:
            raise ValueError(f"checkpoint was sampled with seed {state['seed']}, this run uses {self.seed}")
        self.epoch, self.position = state["epoch"], state["position"]
