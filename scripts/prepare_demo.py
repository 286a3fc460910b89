"""Make the CPU demo's inputs in OUT: the addition task (train.jsonl), its sentencepiece
tokenizer, and a tiny Qwen3-MoE-style checkpoint with that tokenizer's vocabulary."""

import argparse
import os

from megarl.models.tiny_checkpoint import make_tiny_checkpoint
from megarl.rollout.arithmetic_task import arithmetic_records, train_tokenizer, write_jsonl


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", required=True)
    parser.add_argument("--prompts", type=int, default=2000)
    parser.add_argument("--max-operand", type=int, default=9)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    records = arithmetic_records(args.prompts, args.max_operand, args.seed)
    model_dir = os.path.join(args.out, "model")
    os.makedirs(args.out, exist_ok=True)
    write_jsonl(records, os.path.join(args.out, "train.jsonl"))
    train_tokenizer(records, model_dir)
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    make_tiny_checkpoint("qwen3_moe", model_dir, seed=args.seed, vocab_size=len(tokenizer),
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    print(f"demo inputs in {args.out}: {len(records)} prompts, vocab {len(tokenizer)}")


if __name__ == "__main__":
    main()
