"""Whether a folder holds an HF tokenizer: the one list of the files that make one, which the
reward models, the distillation teacher and scripts/evaluate.py all ask about."""

import os

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def has_tokenizer(folder: str) -> bool:
    return os.path.isdir(folder) and any(os.path.isfile(os.path.join(folder, name))
                                         for name in TOKENIZER_FILES)
