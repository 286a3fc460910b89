"""The demo's task, made locally: small additions as prompt/answer records, and a sentencepiece
tokenizer trained on them (digits split, so numbers are spelled digit by digit).

Owns the split of the additions into trained and held-out ones, writing the records (JSONL) and
the tokenizer folder (loadable by transformers' AutoTokenizer, with a chat template that ends
prompts with " Answer:"). Deterministic for a seed. Does not own the model
(models/tiny_checkpoint.py) or scoring (rewards.py).
"""

import json
import random
from typing import Collection, Dict, List, Tuple

from megarl.demo.sentencepiece_tokenizer import train_sentencepiece

CHAT_TEMPLATE = ("{% for m in messages %}{{ m['content'] }}{% endfor %}"
                 "{% if add_generation_prompt %} Answer:{% endif %}")


def addition(a: int, b: int) -> Dict[str, str]:
    return {"prompt": f"What is {a} + {b}?", "answer": str(a + b)}


def heldout_pairs(max_operand: int, count: int, seed: int) -> List[Tuple[int, int]]:
    """The `count` additions kept out of training: of `count` additions a + b with a != b
    (operands 0..max_operand) drawn by seed, one order each; the other stays in training's draw. So
    every held-out addition is new to the model while its sum and its operands are not (a held-out
    *sum* would be an answer the model was never rewarded for, which no amount of RL can raise),
    and a model that learned to add rather than to recall its prompts gets them right. In the
    drawn order: a set's first N prompts (eval.max_prompts) are a sample of it too."""
    unordered = [(a, b) for a in range(max_operand + 1) for b in range(a + 1, max_operand + 1)]
    if not 0 <= count <= len(unordered):
        raise ValueError(f"{count} held-out additions: operands 0..{max_operand} give {len(unordered)} "
                         "pairs a != b to draw them from; hold out fewer or raise max_operand")
    rng = random.Random(f"heldout {seed}")
    return [pair if rng.random() < 0.5 else pair[::-1] for pair in rng.sample(unordered, count)]


def arithmetic_records(count: int, max_operand: int, seed: int,
                       exclude: Collection[Tuple[int, int]] = ()) -> List[Dict[str, str]]:
    """[{"prompt": "What is 3 + 4?", "answer": "7"}, ...]: `count` additions drawn uniformly from
    those with operands 0..max_operand, less the (a, b) pairs in `exclude`."""
    excluded = set(exclude)
    pairs = [(a, b) for a in range(max_operand + 1) for b in range(max_operand + 1) if (a, b) not in excluded]
    rng = random.Random(seed)
    return [addition(*rng.choice(pairs)) for _ in range(count)]


def addition_split(count: int, max_operand: int, heldout: int, seed: int
                   ) -> Tuple[List[Dict[str, str]], List[Dict[str, str]]]:
    """(`count` training records, the `heldout` held-out additions' records, each once)."""
    held = heldout_pairs(max_operand, heldout, seed)
    return arithmetic_records(count, max_operand, seed, exclude=held), [addition(a, b) for a, b in held]


def write_jsonl(records: List[dict], path: str) -> None:
    with open(path, "w") as f:
        for record in records:
            f.write(json.dumps(record) + "\n")


def train_tokenizer(records: List[Dict[str, str]], out_dir: str, vocab_size: int = 48) -> None:
    """A BPE sentencepiece model over the task's text, saved as an HF tokenizer folder."""
    train_sentencepiece([f"{r['prompt']} Answer: {r['answer']}" for r in records], out_dir, vocab_size,
                        CHAT_TEMPLATE)
