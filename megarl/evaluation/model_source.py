"""Which model a folder holds, for the standalone evaluator (scripts/evaluate.py): an HF checkpoint
(a run's exported run_dir/hf among them), or a megarl Megatron checkpoint (a trainer checkpoint
run_dir/checkpoints/step_NNNNNN, whose actor/ is evaluated, or scripts/convert.py hf-to-megatron's
output), converted to HF before vLLM loads it; and where the model's tokenizer is. Decided from
the files alone, before any process group or engine exists."""

import os
from dataclasses import dataclass
from typing import Optional, Sequence

from megarl.models.hf.config import load_hf_config
from megarl.models.hf.tokenizer_files import TOKENIZER_FILES, has_tokenizer
from megarl.models.weights.checkpoint import ASSETS_DIR, MODEL_FILE, read_model_file

HF, MEGATRON = "hf", "megatron"
# A folder with one of these holds a tokenizer AutoTokenizer loads.
_WEIGHTS = (".safetensors", ".bin")
_ACCEPTED = ("an HF checkpoint (config.json and *.safetensors: a run's RUN/hf among them) or a megarl "
             "Megatron checkpoint (RUN/checkpoints/step_NNNNNN, or scripts/convert.py hf-to-megatron's "
             f"output, holding {MODEL_FILE})")


@dataclass(frozen=True)
class ModelSource:
    kind: str  # HF or MEGATRON
    path: str  # the HF folder, or the Megatron checkpoint (a trainer checkpoint's actor/)

    @property
    def tokenizer_home(self) -> str:
        """Where the model's own tokenizer files are, if it holds them (a Megatron checkpoint
        keeps its source's in hf_assets/)."""
        return os.path.join(self.path, ASSETS_DIR) if self.kind == MEGATRON else self.path

    def hf_config(self) -> dict:
        """The model's HF config (a Megatron checkpoint records its source's)."""
        return read_model_file(self.path)["hf_config"] if self.kind == MEGATRON else load_hf_config(self.path)


def model_source(path: str) -> ModelSource:
    """The model `path` (--model) holds; refused, naming what it is instead, where it holds none."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"--model {path!r} does not exist; give {_ACCEPTED}")
    if not os.path.isdir(path):
        raise ValueError(f"--model {path!r} is a file; give the checkpoint's folder: {_ACCEPTED}")
    actor = os.path.join(path, "actor")
    if os.path.isfile(os.path.join(actor, MODEL_FILE)):  # a trainer checkpoint: its policy
        return ModelSource(MEGATRON, actor)
    if os.path.isfile(os.path.join(path, MODEL_FILE)):
        return ModelSource(MEGATRON, path)
    names = os.listdir(path)
    if "config.json" in names and any(name.endswith(_WEIGHTS) for name in names):
        return ModelSource(HF, path)
    if os.path.isdir(os.path.join(path, "checkpoints")) or os.path.isdir(os.path.join(path, "hf")):
        raise ValueError(f"--model {path!r} is a megarl run's folder, not a model: give its exported "
                         f"{os.path.join(path, 'hf')} or one of its checkpoints "
                         f"{os.path.join(path, 'checkpoints', 'step_NNNNNN')}")
    raise ValueError(f"--model {path!r} holds neither kind of checkpoint (found {sorted(names)[:8]}); "
                     f"give {_ACCEPTED}")


def tokenizer_dir(source: ModelSource, fallbacks: Sequence[Optional[str]]) -> str:
    """The model's own tokenizer folder, else the first of `fallbacks` (None: not given) that holds
    one; refused, naming the fix, where none does."""
    for where in (source.tokenizer_home, *(f for f in fallbacks if f)):
        if has_tokenizer(where):
            return where
    tried = [source.tokenizer_home, *(f for f in fallbacks if f)]
    raise FileNotFoundError(f"no tokenizer for --model {source.path!r}: none of {tried} holds "
                            f"{' or '.join(TOKENIZER_FILES)}; pass --tokenizer DIR (the HF checkpoint the "
                            "model was trained from)")
