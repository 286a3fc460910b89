"""The files of an HF tokenizer: those any of which makes a folder hold one (which the reward
models, the distillation teacher and scripts/evaluate.py ask about), and all those a checkpoint
carries beside its weights (a Megatron checkpoint's hf_assets, an HF export)."""

import os

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
TOKENIZER_ASSETS = (*TOKENIZER_FILES, "special_tokens_map.json", "vocab.json", "merges.txt",
                    "generation_config.json", "chat_template.jinja")


def has_tokenizer(folder: str) -> bool:
    return os.path.isdir(folder) and any(os.path.isfile(os.path.join(folder, name))
                                         for name in TOKENIZER_FILES)
