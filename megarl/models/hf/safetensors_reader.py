"""Reading tensors from an HF safetensors checkpoint folder: one model.safetensors file or the
shards a model.safetensors.index.json (or another index, such as mtp.index.json) lists.

Owns opening the files lazily (a tensor is read only when asked for, so a rank holds one at a
time; one shard mapped at a time, so the pages read stay within one shard's) and the refusals
for a missing or unreadable shard. Does not own what the tensors mean:
placing them in Megatron shards is models/hf/weights_io.py's, the MTP layers' models/weights/mtp.py's.
"""

import json
import os
from typing import List, Optional, Tuple

import torch
from safetensors import SafetensorError, safe_open


class SafetensorsReader:
    """Lazy reader over a (possibly sharded) safetensors checkpoint: tensors are read on demand."""

    def __init__(self, hf_dir: str, index: str = "model.safetensors.index.json"):
        index_path = os.path.join(hf_dir, index)
        if os.path.isfile(index_path):
            with open(index_path) as f:
                weight_map = json.load(f)["weight_map"]
        elif os.path.isfile(os.path.join(hf_dir, "model.safetensors")):
            weight_map = None
        else:
            raise FileNotFoundError(
                f"no model.safetensors or model.safetensors.index.json in {hf_dir!r}: megarl "
                f"reads safetensors checkpoints (convert .bin files with transformers first)"
            )
        self.reads = 0  # tensors read so far: the converters report it per rank
        # The one shard mapped now: the pages a mapped shard's reads touch count in the rank's
        # resident memory until it is unmapped (measured: all shards kept open, a rank converting
        # 4 of a block-FP8 checkpoint's 8 layers held the pages of both shards it read).
        self._mapped: Optional[Tuple[str, object]] = None
        self._dir = hf_dir
        if weight_map is None:
            handle = self._open("model.safetensors")
            weight_map = {name: "model.safetensors" for name in handle.keys()}
        self.weight_map = weight_map

    def _open(self, filename: str):
        if self._mapped is None or self._mapped[0] != filename:
            path = os.path.join(self._dir, filename)
            if not os.path.isfile(path):
                raise FileNotFoundError(f"HF checkpoint {self._dir!r}: shard {filename} (listed in "
                                        "model.safetensors.index.json) is missing; copy it again")
            self.close()
            try:
                handle = safe_open(path, framework="pt")
            except SafetensorError as error:  # e.g. a truncated copy: the header promises more bytes
                raise ValueError(f"HF checkpoint {self._dir!r}: {filename} is not a readable safetensors "
                                 f"file ({error}); a truncated or partial copy? Copy it again") from error
            self._mapped = (filename, handle.__enter__())
        return self._mapped[1]

    def names(self) -> List[str]:
        return list(self.weight_map)

    def __call__(self, name: str) -> torch.Tensor:
        if name not in self.weight_map:
            raise KeyError(f"tensor {name!r} is missing from the HF checkpoint in {self._dir!r}")
        self.reads += 1
        return self._open(self.weight_map[name]).get_tensor(name)

    def close(self):
        if self._mapped is not None:
            self._mapped[1].__exit__(None, None, None)
            self._mapped = None
