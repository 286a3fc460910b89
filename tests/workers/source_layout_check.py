"""torchrun worker: several layouts of one world size, several models each. For each layout,
rebuild Megatron's groups; for each model and role, build the model (no weights loaded), gather
every rank's metadata.local_pieces (what a weight sync gathers) and compare them with
source_layout.layout_pieces, computed without the model. Rank 0 prints one JSON line: a result
per (layout, model, role)."""

import argparse
import json

from megarl.models.hf.config import load_arch
from megarl.models.megatron.builder import build_model
from megarl.parallel_state import megatron_groups
from megarl.parallel_state.dims import ParallelDims
from megarl.parallel_state.links import WorldLinks
from megarl.resharding import metadata
from megarl.resharding.source_layout import layout_pieces


def _describe(piece) -> str:
    return f"r{piece.rank} {piece.canonical} tp{piece.tp_rank}/{piece.tp_size} dim={piece.tp_dim} " \
           f"glu={piece.glu} {list(piece.shape)} {piece.dtype}"


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--layouts", required=True, help="JSON list of [name, ParallelDims fields, "
                                                         "[model names]]")
    parser.add_argument("--models", required=True, help="JSON {model name: hf_dir}")
    parser.add_argument("--roles", default="policy,value")
    args = parser.parse_args()
    world = megatron_groups.init_distributed()
    models = json.loads(args.models)
    results = []
    for name, fields, model_names in json.loads(args.layouts):
        dims = ParallelDims(world_size=world, **fields)
        megatron_groups.initialize(dims)
        for model in model_names:
            arch = load_arch(models[model])
            for role in args.roles.split(","):
                chunks = build_model(arch, dims, role=role, perform_initialization=False)
                links = WorldLinks()
                live = metadata.all_pieces(metadata.local_pieces(chunks, arch, links.rank, role)[0], links)
                pure = layout_pieces(arch, dims, role=role)
                only_live = sorted(set(live) - set(pure), key=_describe)
                only_pure = sorted(set(pure) - set(live), key=_describe)
                results.append({
                    "layout": name, "model": model, "role": role, "live": len(live),
                    "pure": len(pure), "distinct_live": len(set(live)),
                    "equal": sorted(live, key=_describe) == sorted(pure, key=_describe),
                    "only_live": [_describe(p) for p in only_live[:5]],
                    "only_pure": [_describe(p) for p in only_pure[:5]],
                })
                del chunks
    if megatron_groups.is_rank0():
        print(json.dumps({"world": world, "results": results}), flush=True)
    megatron_groups.destroy()


if __name__ == "__main__":
    main()
