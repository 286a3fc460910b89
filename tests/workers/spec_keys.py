"""torchrun worker: megarl's portable layer spec against Megatron-Core's own local spec, per model.
For each model, build the policy with megarl's builder (portable spec) and a GPTModel with
Megatron's `get_gpt_layer_local_spec` (whose key map Megatron keeps equal to the Transformer
Engine spec's checkpoint keys), list both models' sharded checkpoint keys, then save the portable
model with megarl's checkpoint writer and load that checkpoint into the local-spec model. Rank 0
prints one JSON line: per model, the keys only one side has and whether every loaded parameter
equals the saved one."""

import argparse
import json
import tempfile

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

from megarl.models.hf.config import load_arch, load_hf_config
from megarl.models.megatron.builder import build_model
from megarl.models.megatron.config import padded_vocab_size, transformer_config
from megarl.models.weights import checkpoint
from megarl.parallel_state import megatron_groups
from megarl.parallel_state.dims import ParallelDims


def _keys(state) -> set:
    if isinstance(state, dict):
        return set().union(*map(_keys, state.values())) if state else set()
    return {state.key}


def _local_spec_model(arch, dims) -> GPTModel:
    # Megatron's torch norms refuse sequence parallelism; checkpoint keys do not depend on it.
    config = transformer_config(arch, dims, sequence_parallel=False)
    spec = get_gpt_layer_local_spec(num_experts=arch.num_experts or None, moe_grouped_gemm=False,
                                    qk_layernorm=arch.qk_norm, normalization="RMSNorm")
    if arch.num_experts:
        # Megatron's local spec also renames a MoE layer's pre-MLP norm to `mlp.linear_fc1.
        # layer_norm_weight`, which no MoE layer has: its TE spec keeps `pre_mlp_layernorm` (a
        # separate TENorm before the router), and TE's names are what checkpoints carry.
        del spec.submodules.sharded_state_dict_keys_map["pre_mlp_layernorm."]
    return GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=padded_vocab_size(arch.vocab_size, dims.tp),
        max_sequence_length=arch.max_position_embeddings,
        share_embeddings_and_output_weights=arch.tie_embeddings, position_embedding_type="rope",
        rotary_base=int(arch.rope_theta))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", required=True, help="JSON {model name: hf_dir}")
    parser.add_argument("--tp", type=int, default=1)
    args = parser.parse_args()
    world = megatron_groups.init_distributed()
    dims = ParallelDims(world_size=world, tp=args.tp)
    megatron_groups.initialize(dims)
    results = {}
    for name, hf_dir in json.loads(args.models).items():
        arch = load_arch(hf_dir)
        portable = build_model(arch, dims)[0]
        local = _local_spec_model(arch, dims)
        mine, megatrons = _keys(portable.sharded_state_dict()), _keys(local.sharded_state_dict())
        folder = [tempfile.mkdtemp(prefix="spec_keys_") if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(folder)
        checkpoint.save([portable], folder[0], load_hf_config(hf_dir))
        with torch.no_grad():
            for param in local.parameters():
                param.fill_(float("nan"))  # whatever the load does not write stays visible
        state = dist_checkpointing.load(local.sharded_state_dict(), folder[0])
        local.load_state_dict(state, strict=True)
        saved = dict(portable.named_parameters())
        loaded = dict(local.named_parameters())
        equal = saved.keys() == loaded.keys() and all(torch.equal(saved[k], loaded[k]) for k in saved)
        results[name] = {"only_portable": sorted(mine - megatrons), "only_local": sorted(megatrons - mine),
                         "keys": sorted(mine), "names_differ": sorted(saved.keys() ^ loaded.keys())[:5],
                         "loaded_equal": equal}
    if megatron_groups.is_rank0():
        print(json.dumps({"world": world, "results": results}), flush=True)
    megatron_groups.destroy()


if __name__ == "__main__":
    main()
