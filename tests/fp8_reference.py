"""The reference for block-FP8 checkpoints: the same model unquantized, each weight dequantized
by vLLM's own block_dequant (tests/test_fp8_checkpoints.py, tests/test_conversion_fuzz.py)."""

import json
import os


def vllm_dequantized(fp8_dir: str, out_dir: str) -> str:
    """The FP8 checkpoint as one unquantized model.safetensors, each weight dequantized by vLLM's
    block_dequant (an independent implementation: a loop over blocks, edges clipped)."""
    from safetensors.torch import load_file, save_file
    from vllm.model_executor.layers.quantization.utils.int8_utils import block_dequant

    with open(os.path.join(fp8_dir, "config.json")) as f:
        config = json.load(f)
    block = config.pop("quantization_config")["weight_block_size"]
    with open(os.path.join(fp8_dir, "model.safetensors.index.json")) as f:
        files = sorted(set(json.load(f)["weight_map"].values()))
    tensors = {}
    for name in files:
        tensors.update(load_file(os.path.join(fp8_dir, name)))
    out = {name: block_dequant(t, tensors[name + "_scale_inv"], block) if name + "_scale_inv" in tensors
           else t for name, t in tensors.items() if not name.endswith("_scale_inv")}
    os.makedirs(out_dir)
    save_file(out, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f)
    return out_dir
