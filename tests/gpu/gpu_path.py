"""Worker: what megarl chooses in this environment, through the calls the smoke runs make:
device_choice.on_gpu(), the backend of the default process group and of every group made, the
classes of the model build_model makes (Transformer Engine's layer spec or megarl's portable one)
and the platform vLLM runs on. Every choice is made from the environment alone, so the runs
started with the same one made the same. Prints one JSON line."""

import argparse
import json

import torch

from megarl.models.hf.config import load_arch
from megarl.models.megatron.builder import build_model
from megarl.parallel_state import megatron_groups
from megarl.parallel_state.dims import ParallelDims
from megarl.platform import device_choice


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--hf-dir", required=True)
    args = parser.parse_args()
    dims = ParallelDims(world_size=megatron_groups.init_distributed())
    megatron_groups.initialize(dims)
    chunks = build_model(load_arch(args.hf_dir), dims, perform_initialization=False)
    from vllm.platforms import current_platform  # the platform vLLM picked for this install

    print(json.dumps({
        "on_gpu": device_choice.on_gpu(),
        "backend": torch.distributed.get_backend(),
        "group_backends": sorted({torch.distributed.get_backend(group)
                                  for group in torch.distributed.distributed_c10d._world.pg_map}),
        "param_device": next(chunks[0].parameters()).device.type,
        "modules": sorted({f"{type(m).__module__}.{type(m).__qualname__}" for m in chunks[0].modules()}),
        "vllm_platform": current_platform.device_type,
    }))
    megatron_groups.destroy()


if __name__ == "__main__":
    main()
