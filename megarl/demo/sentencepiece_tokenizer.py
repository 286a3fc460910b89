"""A BPE sentencepiece tokenizer trained on a demo task's lines (digits split, so numbers are spelled
digit by digit), saved as an HF tokenizer folder with the task's chat template."""

import io
import os
from typing import Dict, List, Sequence


def train_sentencepiece(lines: List[str], out_dir: str, vocab_size: int, chat_template: str,
                        symbols: Sequence[str] = (), **options: Dict) -> None:
    """`symbols`: strings kept as single pieces; `options`: further SentencePieceTrainer options."""
    import sentencepiece as spm
    import transformers

    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_writer=model, vocab_size=vocab_size, model_type="bpe",
        split_digits=True, character_coverage=1.0, unk_id=0, bos_id=1, eos_id=2, pad_id=3,
        minloglevel=2, **({"user_defined_symbols": list(symbols)} if symbols else {}), **options)
    spm_dir = os.path.join(out_dir, "sentencepiece")
    os.makedirs(spm_dir, exist_ok=True)
    with open(os.path.join(spm_dir, "tokenizer.model"), "wb") as f:
        f.write(model.getvalue())
    tokenizer = transformers.LlamaTokenizer.from_pretrained(spm_dir, add_bos_token=False)
    tokenizer.chat_template = chat_template
    tokenizer.save_pretrained(out_dir)
