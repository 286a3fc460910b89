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
    """Every record of a .jsonl or .parquet file."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"prompt file {path!r} does not exist")
    if path.endswith(".jsonl"):
        with open(path) as f:
            return [json.loads(line) for line in f if line.strip()]
    if path.endswith(".parquet"):
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    raise ValueError(f"prompt file {path!r}: use .jsonl or .parquet")


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


def load_prompts(path: str, tokenizer, max_prompt_len: int, prompt_key: str = "prompt",
                 answer_key: str = "answer") -> PromptSet:
    kept, dropped = [], 0
    for index, record in enumerate(read_records(path)):
        if answer_key not in record:
            raise ValueError(f"{path} record {index} has no {answer_key!r} field (keys {sorted(record)});"
                             " set data.answer_key")
        text = render(record, tokenizer, prompt_key)
        ids = tokenizer.encode(text, add_special_tokens=False)
        if len(ids) > max_prompt_len:
            dropped += 1
            continue
        kept.append(Prompt(text, ids, str(record[answer_key])))
    if not kept:
        raise ValueError(f"no prompt of {path} fits max_prompt_len={max_prompt_len} ({dropped} dropped)")
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
