"""Megatron distributed checkpoints of megarl models (megatron.core.dist_checkpointing).

Owns the on-disk layout of a converted model: the torch_dist shards written by Megatron, plus
`megarl_model.json` (the source HF config, so a checkpoint is self-describing) and the HF
tokenizer files under `hf_assets/`. Loads at any TP/PP/EP/ETP/CP layout, written with either layer
spec (Transformer Engine's or the portable one).
"""

import json
import os
import shutil
from typing import Dict, Iterable, List, Set

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.dict_utils import extract_matching_values, nested_values
from megatron.core.dist_checkpointing.mapping import ShardedBase, ShardedTensorFactory
from megatron.core.dist_checkpointing.serialization import load_sharded_metadata

from megarl.models.hf.tokenizer_files import TOKENIZER_ASSETS
from megarl.models.megatron.param_layout import is_adapter

MODEL_FILE = "megarl_model.json"
ASSETS_DIR = "hf_assets"


def _sharded_state_dict(chunks: List[torch.nn.Module]) -> Dict:
    # Keys inside ShardedTensors are layout-independent (global layer ids); the dict nesting
    # only pairs loaded values with chunks. LoRA adapters are not the model's: a run keeps them
    # as a PEFT folder beside it (models/lora/peft_io.py; Megatron would take their TP pieces for copies).
    return {f"chunk{i}": {key: value for key, value in chunk.sharded_state_dict().items()
                          if not is_adapter(key)}
            for i, chunk in enumerate(chunks)}


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
            for name in TOKENIZER_ASSETS:
                if os.path.isfile(os.path.join(hf_dir, name)):
                    shutil.copy2(os.path.join(hf_dir, name), assets)
    dist.barrier()


def read_model_file(ckpt_dir: str) -> Dict:
    path = os.path.join(ckpt_dir, MODEL_FILE)
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"{ckpt_dir!r} is not a megarl Megatron checkpoint: {MODEL_FILE} is missing; create "
            f"one with scripts/convert.py hf-to-megatron"
        )
    with open(path) as f:
        return json.load(f)


def require_model(ckpt_dir: str, hf_config: Dict, source: str) -> None:
    """Raise, naming the differing config fields, unless the checkpoint holds the model that
    `hf_config` (read from `source`) describes."""
    saved = read_model_file(ckpt_dir)["hf_config"]
    # How the HF files store the weights (block FP8, MXFP4) is not the model: the Megatron
    # checkpoint holds them dequantized, whichever copy of the model it was converted from.
    differ = sorted(k for k in (saved.keys() | hf_config.keys()) - {"quantization_config"}
                    if saved.get(k) != hf_config.get(k))
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


def _is_extra_state(key: str) -> bool:
    # Transformer Engine's modules checkpoint their fp8 metadata as `<module>._extra_state`
    # (a grouped expert linear too: its per-expert names all map to that sharded key).
    return key.rsplit(".", 1)[-1] == "_extra_state"


def _some(keys: List[str], shown: int = 8) -> str:
    more = f" and {len(keys) - shown} more" if len(keys) > shown else ""
    return f"{keys[:shown]}{more}"


def drop_absent_extra_state(requested: Iterable[str], stored: Iterable[str], source: str) -> Set[str]:
    """The sharded keys to load: `requested` less the `_extra_state` keys `stored` lacks.

    TE's layer spec asks for `_extra_state` keys (its core attention's and norms') that the
    portable spec (CPU) does not write; tolerating them either way lets a checkpoint written from
    either spec load into the other: a TE module whose key is absent keeps its fresh fp8 metadata,
    a stored one nobody asks for stays unread. Any other key on one side only raises, naming the
    keys (`source`: the checkpoint)."""
    requested, stored = set(requested), set(stored)
    lacking = sorted(k for k in requested - stored if not _is_extra_state(k))
    unused = sorted(k for k in stored - requested if not _is_extra_state(k))
    if lacking or unused:
        found = [f"it lacks the model's {_some(lacking)}"] if lacking else []
        found += [f"it holds {_some(unused)}, which the model does not have"] if unused else []
        raise ValueError(f"Megatron checkpoint {source!r} does not fit this model: {'; '.join(found)}; "
                         "load a checkpoint of this model (scripts/convert.py hf-to-megatron)")
    return requested & stored


def _stored_keys(sh: ShardedBase) -> List[str]:
    """The keys a sharded value is stored under: a factory's (Gated DeltaNet's in_proj and conv1d,
    split into their parts) are those of the tensors it builds."""
    if isinstance(sh, ShardedTensorFactory):
        return [built.key for built in nested_values(sh.build())]
    return [sh.key]


def load(chunks: List[torch.nn.Module], ckpt_dir: str) -> None:
    """Collective: load the checkpoint into this rank's shards at the current layout."""
    read_model_file(ckpt_dir)
    check_files(ckpt_dir)
    request = _sharded_state_dict(chunks)
    mine = sorted({key for sh in nested_values(request) if isinstance(sh, ShardedBase)
                   for key in _stored_keys(sh)})
    # Compared over the whole world: a stored key only another pipeline stage asks for is used,
    # and every rank takes the same decision, so a refusal never leaves the others waiting.
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    stored = {sh.key for sh in load_sharded_metadata(ckpt_dir).values()}
    loadable = drop_absent_extra_state(set().union(*everyone), stored, ckpt_dir)
    kept, request = extract_matching_values(
        request, lambda sh: isinstance(sh, ShardedBase) and not set(_stored_keys(sh)) <= loadable)
    state = dist_checkpointing.load(request, ckpt_dir)
    for i, chunk in enumerate(chunks):
        # What was left out keeps the module's own value, and strict loading still names any other
        # gap. A grouped expert linear's `_extra_state<i>` are sharded-dict names only: its torch
        # state dict holds one `_extra_state`.
        values, own = state[f"chunk{i}"], chunk.state_dict()
        values.update({name: own[name] for name in kept.get(f"chunk{i}", {}) if name in own})
        values.update({name: value for name, value in own.items() if is_adapter(name)})  # not stored
        chunk.load_state_dict(values, strict=True)
