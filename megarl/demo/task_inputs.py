"""A demo task's inputs before any warm start: OUT/train.jsonl, the task's sentencepiece tokenizer
in OUT/model, and a random tiny checkpoint there with that tokenizer's vocabulary and special ids.
scripts/prepare_demo.py warm-starts and converts on top of it; the config tests preflight it."""

import os

from megarl.demo.arithmetic_task import arithmetic_records, train_tokenizer, write_jsonl
from megarl.demo.tiny_checkpoint import make_tiny_checkpoint
from megarl.demo.tool_task import tool_records, train_tool_tokenizer

TASKS = ("addition", "tools")


def write_task_inputs(out: str, task: str, prompts: int, max_operand: int, seed: int, model: str):
    """Write `task`'s inputs into `out` (see the module docstring); returns (records, tokenizer)."""
    import transformers  # slow to import: only where inputs are made

    if task not in TASKS:
        raise ValueError(f"task {task!r}: choose one of {TASKS}")
    tools = task == "tools"
    records = tool_records(prompts, seed) if tools else arithmetic_records(prompts, max_operand, seed)
    model_dir = os.path.join(out, "model")
    os.makedirs(out, exist_ok=True)
    write_jsonl(records, os.path.join(out, "train.jsonl"))
    (train_tool_tokenizer if tools else train_tokenizer)(records, model_dir)
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    make_tiny_checkpoint(model, model_dir, seed=seed, vocab_size=len(tokenizer),
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    return records, tokenizer
