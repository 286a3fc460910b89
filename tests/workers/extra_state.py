"""torchrun worker: checkpoints written from either layer spec load into the other, `_extra_state`
(Transformer Engine's fp8 metadata) tolerated where one side lacks it, nothing else.

Transformer Engine does not import on the CPU path, so a "TE model" here is megarl's portable
model whose linears, core attention and q/k norms carry fp8 metadata the way TE's modules do: a
BytesIO from get_extra_state (a ShardedObject `<module>._extra_state` in the sharded state dict),
None ignored by set_extra_state. Megatron's local linears already write a None `_extra_state`, so
the portable checkpoint has those keys but lacks the core attention's and the norms'.

Each case writes with megarl's checkpoint writer and loads with megarl's loader into a model whose
parameters are NaN (so whatever the load does not write stays visible). Rank 0 prints one JSON
line with every rank's results."""

import argparse
import functools
import io
import json
import os
import zlib

import torch
import torch.distributed as dist
from megatron.core.dist_checkpointing import ShardedTensor
from megatron.core.dist_checkpointing.serialization import load_sharded_metadata

from megarl.models.hf.config import load_arch, load_hf_config
from megarl.models.megatron.builder import build_model
from megarl.models.weights import checkpoint
from megarl.parallel_state import megatron_groups
from megarl.parallel_state.dims import ParallelDims

TE_MODULES = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2", "core_attention",
              "q_layernorm", "k_layernorm")


class _Fp8Meta:
    def get_extra_state(self):
        buffer = io.BytesIO()
        torch.save(self.fp8_meta, buffer)
        return buffer

    def set_extra_state(self, state):
        if state is None:  # as TE: a checkpoint without fp8 metadata leaves it as it is
            return
        state.seek(0)
        self.fp8_meta = torch.load(state)


@functools.cache
def _with_fp8_meta(cls: type) -> type:
    # torch looks get_extra_state up on the class: a subclass per module class, not per instance.
    return type(f"TE{cls.__name__}", (_Fp8Meta, cls), {})


def _meta(name: str, seed: int) -> torch.Tensor:
    return torch.tensor([float(seed), float(zlib.crc32(name.encode()) % 997)])


def te_like(model, seed: int):
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] in TE_MODULES:
            module.__class__ = _with_fp8_meta(type(module))
            module.fp8_meta = _meta(name, seed)
    return model


def metas(model) -> dict:
    return {name: m.fp8_meta for name, m in model.named_modules() if isinstance(m, _Fp8Meta)}


class _Edited:
    """A chunk whose sharded state dict leaves out `drop` (a sharded key) and adds `add`."""

    def __init__(self, model, drop: str = None, add: dict = None):
        self.model, self.drop, self.add = model, drop, add or {}

    def sharded_state_dict(self):
        kept = {k: v for k, v in self.model.sharded_state_dict().items() if v.key != self.drop}
        return {**kept, **self.add}


def nan_model(arch, dims, te: bool):
    model = build_model(arch, dims)[0]
    with torch.no_grad():
        for param in model.parameters():
            param.fill_(float("nan"))
    return te_like(model, seed=2) if te else model


def equal_weights(loaded, saved) -> bool:
    a, b = dict(loaded.named_parameters()), dict(saved.named_parameters())
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def load_error(chunks, ckpt_dir):
    try:
        checkpoint.load(chunks, ckpt_dir)
    except ValueError as error:
        return str(error)
    return None


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--hf-dir", required=True)
    parser.add_argument("--out-dir", required=True)
    parser.add_argument("--pp", type=int, default=1)
    args = parser.parse_args()
    world = megatron_groups.init_distributed()
    dims = ParallelDims(world_size=world, pp=args.pp)
    megatron_groups.initialize(dims)
    arch, hf_config = load_arch(args.hf_dir), load_hf_config(args.hf_dir)
    out = {name: os.path.join(args.out_dir, name) for name in ("portable", "te", "lacking", "extra")}

    portable = build_model(arch, dims)[0]
    te = te_like(build_model(arch, dims)[0], seed=1)
    checkpoint.save([portable], out["portable"], hf_config)
    checkpoint.save([te], out["te"], hf_config)
    last = megatron_groups.is_last_stage()
    checkpoint.save([_Edited(portable, drop="decoder.final_layernorm.weight" if last else None)],
                    out["lacking"], hf_config)
    # On every stage, replicated: the first rank's copy is the main one.
    unknown = ShardedTensor.from_rank_offsets("decoder.unknown.weight", torch.ones(4),
                                              replica_id=dist.get_rank())
    checkpoint.save([_Edited(portable, add={"decoder.unknown.weight": unknown})], out["extra"], hf_config)

    stored = {name: {sh.key for sh in load_sharded_metadata(out[name]).values()}
              for name in ("portable", "te")}
    result = {"te_only_keys": sorted(stored["te"] - stored["portable"]),
              "portable_only_keys": sorted(stored["portable"] - stored["te"])}

    reader = nan_model(arch, dims, te=True)
    checkpoint.load([reader], out["portable"])
    result["portable_into_te"] = {
        "weights_equal": equal_weights(reader, portable),
        "metas_fresh": all(torch.equal(m, _meta(n, 2)) for n, m in metas(reader).items())}

    reader = nan_model(arch, dims, te=False)
    checkpoint.load([reader], out["te"])
    result["te_into_portable"] = {"weights_equal": equal_weights(reader, te)}

    reader = nan_model(arch, dims, te=True)
    checkpoint.load([reader], out["te"])
    result["te_into_te"] = {
        "weights_equal": equal_weights(reader, te), "metas": len(metas(reader)),
        "metas_loaded": all(torch.equal(m, _meta(n, 1)) for n, m in metas(reader).items())}

    result["lacking_error"] = load_error([nan_model(arch, dims, te=True)], out["lacking"])
    result["extra_error"] = load_error([nan_model(arch, dims, te=False)], out["extra"])

    everyone = [None] * world
    dist.all_gather_object(everyone, result)
    if megatron_groups.is_rank0():
        print(json.dumps({"world": world, "ranks": everyone}), flush=True)
    megatron_groups.destroy()


if __name__ == "__main__":
    main()
