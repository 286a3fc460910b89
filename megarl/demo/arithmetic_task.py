"""The demo's task, made locally: small additions as prompt/answer records, and a sentencepiece
tokenizer trained on them (digits split, so numbers are spelled digit by digit).

Owns writing the records (JSONL) and the tokenizer folder (loadable by transformers'
AutoTokenizer, with a chat template that ends prompts with " Answer:"). Deterministic for a seed.
Does not own the model (models/tiny_checkpoint.py) or scoring (rewards.py).
"""

import json
import random
from typing import Dict, List

from megarl.demo.sentencepiece_tokenizer import train_sentencepiece

CHAT_TEMPLATE = ("{% for m in messages %}{{ m['content'] }}{% endfor %}"
                 "{% if add_generation_prompt %} Answer:{% endif %}")


def arithmetic_records(count: int, max_operand: int, seed: int) -> List[Dict[str, str]]:
    """[{"prompt": "What is 3 + 4?", "answer": "7"}, ...]"""
    rng = random.Random(seed)
    records = []
    for _ in range(count):
        a, b = rng.randint(0, max_operand), rng.randint(0, max_operand)
        records.append({"prompt": f"What is {a} + {b}?", "answer": str(a + b)})
    return records


def write_jsonl(records: List[dict], path: str) -> None:
    with open(path, "w") as f:
        for record in records:
            f.write(json.dumps(record) + "\n")


def train_tokenizer(records: List[Dict[str, str]], out_dir: str, vocab_size: int = 48) -> None:
    """A BPE sentencepiece model over the task's text, saved as an HF tokenizer folder."""
    train_sentencepiece([f"{r['prompt']} Answer: {r['answer']}" for r in records], out_dir, vocab_size,
                        CHAT_TEMPLATE)
