"""A demo task's inputs before any warm start: OUT/train.jsonl (the training prompts), for the
addition task OUT/heldout.jsonl (additions no training prompt asks, each once:
arithmetic_task.heldout_pairs; make demo evaluates it), the task's sentencepiece tokenizer in
OUT/model, and a random tiny checkpoint there with that tokenizer's vocabulary and special ids.
scripts/prepare_demo.py warm-starts and converts on top of it; the config tests preflight it."""

import os

from megarl.demo.arithmetic_task import addition_split, train_tokenizer, write_jsonl
from megarl.demo.tiny_checkpoint import make_tiny_checkpoint
from megarl.demo.tool_task import tool_records, train_tool_tokenizer

TASKS = ("addition", "tools")


def write_task_inputs(out: str, task: str, prompts: int, max_operand: int, seed: int, model: str,
                      heldout: int = 0, dtype: str = "float32"):
    """Write `task`'s inputs into `out` (see the module docstring), with `heldout` held-out additions
    (addition task; 0: no heldout.jsonl) and the checkpoint stored in `dtype`; returns (records,
    tokenizer)."""
    import transformers  # slow to import: only where inputs are made

    if task not in TASKS:
        raise ValueError(f"task {task!r}: choose one of {TASKS}")
    tools = task == "tools"
    model_dir = os.path.join(out, "model")
    os.makedirs(out, exist_ok=True)
    if tools:
        records = tool_records(prompts, seed)
    else:
        records, held = addition_split(prompts, max_operand, heldout, seed)
        if held:
            write_jsonl(held, os.path.join(out, "heldout.jsonl"))
    write_jsonl(records, os.path.join(out, "train.jsonl"))
    (train_tool_tokenizer if tools else train_tokenizer)(records, model_dir)
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    make_tiny_checkpoint(model, model_dir, seed=seed, vocab_size=len(tokenizer),
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id, dtype=dtype)
    return records, tokenizer
