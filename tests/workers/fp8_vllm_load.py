"""One process: vLLM's own model loader reads a block-FP8 HF checkpoint into vLLM's model (its
Fp8LinearMethod and Fp8MoEMethod parameters: fused qkv and gate/up, stacked experts, the fp32
weight_scale_inv beside each), and every parameter is compared with the checkpoint's tensors.

vLLM's CPU build has no block-FP8 matmul here: LLM(...) fails while building the model
("CPUFp8BlockScaledMMKernel requires AMX tile support"). So the model is built and loaded as
vLLM's loader does it (initialize_model, then the loader's load_weights), with the matmul kernel's
choice, which only the forward uses, left empty; process_weights_after_loading (the kernel's
repacking) is not run.

  python tests/workers/fp8_vllm_load.py --hf-dir DIR
prints {"compared": N, "mismatched": [...], "not_in_checkpoint": [...], "unread": [...]}.
"""

import argparse
import json
import os
import socket

import torch

from megarl.models.hf.safetensors_reader import SafetensorsReader

# vLLM's fused parameters and the checkpoint tensors they concatenate along rows, in order.
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj"),
         "fused_qkv_a_proj": ("q_a_proj", "kv_a_proj_with_mqa")}
EXPERTS = {"w13_weight": ("gate_proj", "up_proj"), "w2_weight": ("down_proj",)}
VOCAB = ("embed_tokens.weight", "lm_head.weight")


def _parts(name: str):
    """(the checkpoint names a vLLM parameter is made of, number of experts stacked or 0)."""
    module, _, leaf = name.rpartition(".")
    if ".experts.routed_experts" in module:
        base = module.replace(".routed_experts", "")
        weight = leaf.replace("_scale_inv", "")
        suffix = "weight" + leaf[len(weight):]
        return [f"{base}.{{e}}.{part}.{suffix}" for part in EXPERTS[weight]], True
    owner, _, layer = module.rpartition(".")
    return [".".join(filter(None, (owner, part, leaf))) for part in FUSED.get(layer, (layer,))], False


def _expected(name: str, reader: SafetensorsReader, experts: int):
    parts, stacked = _parts(name)
    if not stacked:
        return torch.cat([reader(p) for p in parts]) if all(p in reader.weight_map for p in parts) else None
    return torch.stack([torch.cat([reader(p.format(e=e)) for p in parts]) for e in range(experts)])


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.view(torch.uint8) if tensor.dtype == torch.float8_e4m3fn else tensor


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--hf-dir", required=True)
    args = parser.parse_args()
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm.config import set_current_vllm_config
    from vllm.distributed import ensure_model_parallel_initialized, init_distributed_environment
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.layers.quantization import fp8 as vllm_fp8
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.model_executor.model_loader.utils import initialize_model

    config = EngineArgs(model=args.hf_dir, skip_tokenizer_init=True, dtype="bfloat16", enforce_eager=True,
                        max_model_len=128).create_engine_config()
    vllm_fp8.init_fp8_linear_kernel = lambda **_: None  # no block-FP8 matmul on this CPU (above)
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    with set_current_vllm_config(config):
        init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                     distributed_init_method=f"tcp://127.0.0.1:{port}")
        ensure_model_parallel_initialized(1, 1)
        model = initialize_model(vllm_config=config, model_config=config.model_config)
        get_model_loader(config.load_config).load_weights(model, config.model_config)
    reader = SafetensorsReader(args.hf_dir)
    hf_config = config.model_config.hf_config
    experts = getattr(hf_config, "num_experts", None) or getattr(hf_config, "n_routed_experts", 0)
    compared, mismatched, missing, read = 0, [], [], set()
    for name, param in model.named_parameters():
        expected = _expected(name, reader, experts)
        if expected is None:
            missing.append(name)
            continue
        parts, stacked = _parts(name)
        read.update(p.format(e=e) for p in parts for e in (range(experts) if stacked else [0]))
        # bf16 tensors come back in the engine's dtype (exactly: a widening); FP8 codes bit for bit
        if param.dtype != expected.dtype and expected.dtype == torch.bfloat16:
            expected = expected.to(param.dtype)
        held = param.data
        if name.endswith(VOCAB):  # vLLM pads the vocabulary rows
            held = held[:expected.shape[0]]
        if held.shape != expected.shape or not torch.equal(_bits(held), _bits(expected)):
            mismatched.append([name, list(held.shape), str(held.dtype), list(expected.shape),
                               str(expected.dtype)])
        compared += 1
    print(json.dumps({"compared": compared, "mismatched": mismatched, "not_in_checkpoint": missing,
                      "unread": sorted(set(reader.weight_map) - read)}))


if __name__ == "__main__":
    main()
