"""Megatron distributed checkpoints of megarl models (megatron.core.dist_checkpointing).

Owns the on-disk layout of a converted model: the torch_dist shards written by Megatron, plus
`megarl_model.json` (the source HF config, so a checkpoint is self-describing) and the HF
tokenizer files under `hf_assets/`. Loads at any TP/PP/EP/ETP/CP layout.
"""

import json
import os
import shutil
from typing import Dict, List

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing

MODEL_FILE = "megarl_model.json"
ASSETS_DIR = "hf_assets"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model",
                   "special_tokens_map.json", "vocab.json", "merges.txt", "generation_config.json",
                   "chat_template.jinja")


def _sharded_state_dict(chunks: List[torch.nn.Module]) -> Dict:
    # Keys inside ShardedTensors are layout-independent (global layer ids); the dict nesting
    # only pairs loaded values with chunks.
    return {f"chunk{i}": chunk.sharded_state_dict() for i, chunk in enumerate(chunks)}


def save(chunks: List[torch.nn.Module], out_dir: str, hf_config: Dict, hf_dir: str = None) -> None:
    """Collective over the world: every rank writes its shards."""
    os.makedirs(out_dir, exist_ok=True)
    dist_checkpointing.save(_sharded_state_dict(chunks), out_dir)
    if dist.get_rank() == 0:
        with open(os.path.join(out_dir, MODEL_FILE), "w") as f:
            json.dump({"hf_config": hf_config}, f, indent=2)
        if hf_dir:
            assets = os.path.join(out_dir, ASSETS_DIR)
            os.makedirs(assets, exist_ok=True)
            for name in TOKENIZER_FILES:
                if os.path.isfile(os.path.join(hf_dir, name)):
                    shutil.copy2(os.path.join(hf_dir, name), assets)
    dist.barrier()


def read_model_file(ckpt_dir: str) -> Dict:
    path = os.path.join(ckpt_dir, MODEL_FILE)
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"{ckpt_dir!r} is not a megarl Megatron checkpoint: {MODEL_FILE} is missing; create "
            f"one with scripts/convert_hf_to_megatron.py"
        )
    with open(path) as f:
        return json.load(f)


def require_model(ckpt_dir: str, hf_config: Dict, source: str) -> None:
    """Raise, naming the differing config fields, unless the checkpoint holds the model that
    `hf_config` (read from `source`) describes."""
    saved = read_model_file(ckpt_dir)["hf_config"]
    differ = sorted(k for k in saved.keys() | hf_config.keys() if saved.get(k) != hf_config.get(k))
    if differ:
        raise ValueError(f"checkpoint {ckpt_dir!r} holds a different model than {source!r}: config fields "
                         f"{differ} differ (e.g. {differ[0]}: {saved.get(differ[0])!r} vs "
                         f"{hf_config.get(differ[0])!r}); use the checkpoint made from that model")


def check_files(ckpt_dir: str) -> None:
    """Every byte range the checkpoint's index (.metadata) names lies in a shard file that exists:
    a missing or truncated shard is refused by name before any rank loads (the loader would fail
    on some ranks only, with a bare I/O or unpickling error, while the others wait)."""
    from torch.distributed.checkpoint import FileSystemReader

    try:
        storage = FileSystemReader(ckpt_dir).read_metadata().storage_data
    except (OSError, EOFError, RuntimeError, ValueError) as error:
        raise ValueError(f"Megatron checkpoint {ckpt_dir!r}: its index .metadata is missing or unreadable "
                         f"({type(error).__name__}); copy the checkpoint again or use another one") from error
    ends: Dict[str, int] = {}
    for info in storage.values():
        ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    for name, end in sorted(ends.items()):
        path = os.path.join(ckpt_dir, name)
        size = os.path.getsize(path) if os.path.isfile(path) else None
        if size is None or size < end:
            found = "is missing" if size is None else f"has {size} bytes of the {end} its index names"
            raise ValueError(f"Megatron checkpoint {ckpt_dir!r} is incomplete: shard {name} {found}; "
                             "copy the checkpoint again or use another one")


def load(chunks: List[torch.nn.Module], ckpt_dir: str) -> None:
    """Collective: load the checkpoint into this rank's shards at the current layout."""
    read_model_file(ckpt_dir)
    check_files(ckpt_dir)
    state = dist_checkpointing.load(_sharded_state_dict(chunks), ckpt_dir)
    for i, chunk in enumerate(chunks):
        chunk.load_state_dict(state[f"chunk{i}"], strict=True)
