"""The demo's task, made locally: small additions as prompt/answer records, and a sentencepiece
tokenizer trained on them (digits split, so numbers are spelled digit by digit).

Owns writing the records (JSONL) and the tokenizer folder (loadable by transformers'
AutoTokenizer, with a chat template that ends prompts with " Answer:"). Deterministic for a seed.
Does not own the model (models/tiny_checkpoint.py) or scoring (rewards.py).
"""

import io
import json
import os
import random
from typing import Dict, List

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
    import sentencepiece as spm
    import transformers

    lines = [f"{r['prompt']} Answer: {r['answer']}" for r in records]
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_writer=model, vocab_size=vocab_size, model_type="bpe",
        split_digits=True, character_coverage=1.0, unk_id=0, bos_id=1, eos_id=2, pad_id=3,
        minloglevel=2)
    os.makedirs(out_dir, exist_ok=True)
    spm_dir = os.path.join(out_dir, "sentencepiece")
    os.makedirs(spm_dir, exist_ok=True)
    with open(os.path.join(spm_dir, "tokenizer.model"), "wb") as f:
        f.write(model.getvalue())
    tokenizer = transformers.LlamaTokenizer.from_pretrained(spm_dir, add_bos_token=False)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(out_dir)
