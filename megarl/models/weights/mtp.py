"""The multi-token-prediction (MTP) layers DeepSeek-V3 and GLM-4.5 checkpoints store after their
last decoder layer (`model.layers.{num_hidden_layers + i}.*`), and Qwen3-Next's under `mtp.*`:
megarl does not train them, and keeps them byte for byte through every conversion and export,
so a trained checkpoint still serves speculative decoding.

Owns: which HF names are MTP weights, and copying them between checkpoint folders in bounded
memory. A Megatron checkpoint keeps them under hf_assets/ as mtp-NNNNN.safetensors files with
their own index, mtp.index.json.

A config may declare MTP layers whose weights the checkpoint lacks: transformers' save_pretrained
does not build them, so every DeepSeek-V3 / GLM-4.5 checkpoint it writes (and many fine-tuned
ones) is like that. They are carried as absent: no index in hf_assets, none in the export, the
config as it came (transformers and vLLM load it: they build no MTP layers), and a note saying so.
"""

import json
import os
import re
from typing import Callable, Dict, Iterable, List, Optional

from safetensors.torch import save_file

from megarl.models.hf.config import HYBRIDS, VISION_TOWER, ModelArch
from megarl.models.hf.fp8_reader import dequantizing
from megarl.models.hf.safetensors_reader import SafetensorsReader

INDEX = "mtp.index.json"
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
# Tensors per file: bounded host memory for a 10+ GB MTP layer of a giant MoE.
_FILE_BYTES = 1 << 30
_HF_WEIGHTS = ("model.safetensors", "model.safetensors.index.json")


def _hybrid(arch: ModelArch) -> bool:
    """Qwen3-Next keeps its MTP layers apart, under `mtp.` (layers, fc, norms)."""
    return arch.family in HYBRIDS


def _kept_aside(arch: ModelArch) -> bool:
    """Whether the checkpoint may hold tensors megarl keeps aside: MTP layers, a vision tower."""
    return bool(arch.mtp_layers) or arch.family in VISION_TOWER


def mtp_names(arch: ModelArch, names: Iterable[str]) -> List[str]:
    """The names among `names` that belong to the checkpoint's MTP layers, and to its vision tower
    (Qwen3.5-MoE's `model.visual.`: kept and given back unchanged the same way, not trained)."""
    if _hybrid(arch):
        tower = VISION_TOWER.get(arch.family)
        return sorted(n for n in names if (arch.mtp_layers and n.startswith("mtp."))
                      or (tower and n.startswith(tower)))
    first, last = arch.num_layers, arch.num_layers + arch.mtp_layers
    return sorted(n for n in names if (m := _LAYER.match(n)) and first <= int(m.group(1)) < last)


def source(folder: str, arch: ModelArch):
    """A reader over the MTP tensors of an HF checkpoint folder or of a Megatron checkpoint's
    hf_assets folder; None when there are none. A block-FP8 checkpoint's read dequantized into
    the model's dtype, as its other layers are: hf_assets and the exports hold them unquantized."""
    if os.path.isfile(os.path.join(folder, INDEX)):
        return dequantizing(SafetensorsReader(folder, index=INDEX), arch, folder)
    # No MTP index and no HF weights (a Megatron checkpoint's hf_assets, an HF folder of config
    # and tokenizer only): the MTP weights are absent, not unreadable.
    if not _kept_aside(arch) or not any(os.path.isfile(os.path.join(folder, name)) for name in _HF_WEIGHTS):
        return None
    reader = dequantizing(SafetensorsReader(folder), arch, folder)
    if not mtp_names(arch, reader.names()):
        reader.close()
        return None
    return reader


def copy(arch: ModelArch, reader, out_dir: str, prefix: str = "mtp",
         convert: Optional[Callable[[Dict], Dict]] = None) -> Dict[str, str]:
    """Write the reader's MTP tensors into out_dir as PREFIX-NNNNN.safetensors files, about 1 GiB
    each, each file's tensors through `convert` when given; return their weight map (name -> file
    name)."""
    weight_map, batch, size = {}, {}, 0

    def flush():
        nonlocal batch, size
        if batch:
            batch = convert(batch) if convert else batch
            filename = f"{prefix}-{len(set(weight_map.values())) + 1:05d}.safetensors"
            save_file(batch, os.path.join(out_dir, filename), metadata={"format": "pt"})
            weight_map.update({name: filename for name in batch})
            batch, size = {}, 0

    for name in mtp_names(arch, reader.names()):
        tensor = reader(name).contiguous()
        batch[name] = tensor
        size += tensor.numel() * tensor.element_size()
        if size >= _FILE_BYTES:
            flush()
    flush()
    return weight_map


def keep_in_assets(arch: ModelArch, hf_dir: str, assets_dir: str) -> int:
    """HF -> Megatron: the MTP tensors into the checkpoint's hf_assets; returns how many."""
    reader = source(hf_dir, arch)
    if reader is None:
        return 0
    try:
        weight_map = copy(arch, reader, assets_dir)
    finally:
        reader.close()
    with open(os.path.join(assets_dir, INDEX), "w") as f:
        json.dump({"weight_map": weight_map}, f, indent=2, sort_keys=True)
    return len(weight_map)


def restore(arch: ModelArch, folder: Optional[str], out_dir: str,
            convert: Optional[Callable[[Dict], Dict]] = None) -> Dict[str, str]:
    """-> HF: the MTP tensors of `folder` (HF folder or hf_assets) into out_dir as
    mtp-NNNNN.safetensors, through `convert` when given (an FP8 export quantizes them as its other
    layers); returns the entries to add to the HF index."""
    reader = source(folder, arch) if folder else None
    if reader is None:
        return {}
    try:
        return copy(arch, reader, out_dir, convert=convert)
    finally:
        reader.close()


def absent_notes(arch: ModelArch, kept: int, folder: Optional[str]) -> List[str]:
    """A conversion's or export's notes on MTP: one when the config declares MTP layers and `kept`
    (the MTP tensors carried over from `folder`) is 0, else none."""
    if not arch.mtp_layers or kept:
        return []
    first, last = arch.num_layers, arch.num_layers + arch.mtp_layers - 1
    layers = f"model.layers.{first}.*" if first == last else f"model.layers.{first}-{last}.*"
    field = "num_nextn_predict_layers"
    if _hybrid(arch):
        layers, field = "mtp.*", "mtp_num_hidden_layers"
    return [f"MTP weights absent: config.json declares {field}={arch.mtp_layers} but "
            f"{folder!r} holds no {layers} tensors (checkpoints transformers' save_pretrained "
            "writes lack them); carried as absent, config.json kept as it is (transformers and vLLM "
            f"load it); for vLLM's MTP speculative decoding add {layers} from the published checkpoint"]
