"""Prompts for rollouts: reading JSONL/Parquet records, rendering and tokenizing them, filtering
by length, and sampling batches in a seeded, resumable order.

A record holds a prompt (text, or a chat: [{"role", "content"}, ...]) and a ground truth for the
reward, and optionally the data source and extra info a reward function may use. Where each lives
is a key path (RecordKeys; dotted for nested fields: `reward_model.ground_truth`). The defaults read
megarl's own files (`prompt`, `answer`) and verl's as its preprocessing writes them (`prompt` as chat
messages, `reward_model.ground_truth`, `data_source`, `extra_info`) with no key set; slime's and
NeMo-RL's layouts by naming their keys (docs/data-and-rewards.md). A record without the prompt key
but with `messages` is read as that chat. A tokenizer with a chat template renders both kinds as a
chat with the generation prompt; without one, text is used as is.
Does not own generation or rewards.
"""

import json
import os
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

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


def lookup(record: dict, path: str, default: Any = None) -> Any:
    """record's value at a dotted key path ('reward_model.ground_truth'); `default` where a part
    of the path is missing."""
    value = record
    for part in path.split("."):
        if not isinstance(value, dict) or part not in value:
            return default
        value = value[part]
    return value


# Where the ground truth lives when data.answer_key is "auto": megarl's files, then verl's.
ANSWER_PATHS = ("answer", "reward_model.ground_truth")


@dataclass(frozen=True)
class RecordKeys:
    """Key paths of a record's fields (data.prompt_key, ...). answer "auto": ANSWER_PATHS, the
    first the file's first record holds."""
    prompt: str = "prompt"
    answer: str = "auto"
    data_source: str = "data_source"  # optional in a record: "" where missing
    extra_info: str = "extra_info"  # optional in a record: {} where missing

    def resolved(self, first: dict, path: str) -> "RecordKeys":
        if self.answer != "auto":
            return self
        for candidate in ANSWER_PATHS:
            if lookup(first, candidate) is not None:
                return RecordKeys(self.prompt, candidate, self.data_source, self.extra_info)
        raise ValueError(f"{path} record 0 has none of the ground-truth fields {list(ANSWER_PATHS)} "
                         f"(keys {sorted(first)}); set data.answer_key to its key path, e.g. "
                         "data.answer_key=label or data.answer_key=meta.solution")


def _chat(record: dict, keys: RecordKeys, where: str) -> Optional[List[dict]]:
    """The record's chat messages, or None when its prompt is text. Refused: an empty chat, a
    message without role and content, and a chat whose last turn is the assistant's (rendered with
    a generation prompt after it, the answer would be in the prompt)."""
    value = lookup(record, keys.prompt)
    name = keys.prompt
    if value is None and "messages" in record:
        value, name = record["messages"], "messages"
    if not isinstance(value, list):
        return None
    if not value or not any(str(m.get("content", "")).strip() for m in value if isinstance(m, dict)):
        raise ValueError(f"{where}: {name!r} holds no text ({value!r}); remove the record")
    for message in value:
        if not isinstance(message, dict) or "role" not in message or "content" not in message:
            raise ValueError(f"{where}: {name!r} holds {message!r}, not a chat message "
                             "{'role': ..., 'content': ...}")
    if value[-1]["role"] == "assistant":
        raise ValueError(f"{where}: {name!r} ends with an assistant turn ({value[-1]['content']!r}), "
                         "which would be part of the prompt; drop it from the prompt (an answer goes "
                         "in the field data.answer_key names)")
    return value


def render(record: dict, tokenizer, keys: RecordKeys, where: str) -> Tuple[List[dict], str]:
    """(the prompt as chat messages, the text the policy is given): a text prompt is one user turn,
    given as it is to a tokenizer without a chat template."""
    messages = _chat(record, keys, where)
    if messages is None:
        text = lookup(record, keys.prompt)
        if not isinstance(text, str) or not text.strip():
            raise ValueError(f"{where}: {keys.prompt!r} is {text!r}, not a non-empty string or chat "
                             f"(keys {sorted(record)}); remove the record or point data.prompt_key at "
                             "the prompt field")
        if not getattr(tokenizer, "chat_template", None):
            return [{"role": "user", "content": text}], text
        messages = [{"role": "user", "content": text}]
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"{where}: chat messages need a tokenizer with a chat template; this one has none")
    return messages, tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


@dataclass(frozen=True)
class Prompt:
    text: str
    token_ids: List[int]
    answer: Any  # the ground truth as the file holds it (a string for most tasks)
    data_source: str = ""
    extra_info: Dict[str, Any] = field(default_factory=dict)
    messages: Tuple[Dict[str, Any], ...] = ()  # the prompt as chat messages (for judges, reward models)


@dataclass(frozen=True)
class PromptSet:
    prompts: List[Prompt]
    dropped_too_long: int  # records whose prompt exceeded max_prompt_len tokens


OVERLONG = ("skip", "error")


def load_prompts(path: str, tokenizer, max_prompt_len: int, keys: Optional[RecordKeys] = None,
                 overlong: str = "skip") -> PromptSet:
    """The file's prompts, rendered and tokenized. A missing field or an empty prompt is an
    error naming the record; a prompt over `max_prompt_len` tokens is skipped and counted, or
    with overlong="error" refused."""
    if overlong not in OVERLONG:
        raise ValueError(f"data.overlong_prompts={overlong!r}; choose one of {OVERLONG}")
    records = read_records(path)
    if not records:
        raise ValueError(f"prompt file {path} holds no records")
    keys = (keys or RecordKeys()).resolved(records[0], path)
    kept, dropped = [], 0
    for index, record in enumerate(records):
        where = f"{path} record {index}"
        answer = lookup(record, keys.answer)
        if answer is None:
            raise ValueError(f"{where} has no {keys.answer!r} field (keys {sorted(record)}); "
                             "set data.answer_key to the ground truth's key path")
        extra_info = lookup(record, keys.extra_info) or {}
        if not isinstance(extra_info, dict):
            raise ValueError(f"{where}: {keys.extra_info!r} is {extra_info!r}, not a mapping; point "
                             "data.extra_info_key at a mapping field")
        messages, text = render(record, tokenizer, keys, where)
        ids = tokenizer.encode(text, add_special_tokens=False)
        if len(ids) > max_prompt_len:
            if overlong == "error":
                raise ValueError(f"{where} is {len(ids)} tokens, over data.max_prompt_len={max_prompt_len}; "
                                 "raise data.max_prompt_len or set data.overlong_prompts=skip")
            dropped += 1
            continue
        kept.append(Prompt(text, ids, answer, str(lookup(record, keys.data_source) or ""), extra_info,
                           tuple(messages)))
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
