"""torchrun worker: the run's live HF export (megarl.resharding.hf_export) of IN's model at one
pipeline stage per rank, recording every receive the sync posts. Rank 0 prints one JSON line:
{"links_device", "receives": [[device, bytes, whether it lands straight in a tensor the writer
opened]]}. What a GPU would refuse shows here only as a device that is not the links'.

  torchrun --nproc-per-node 2 tests/workers/export_receives.py --hf-dir IN --out OUT
"""

import argparse
import json

from megarl.models.hf.config import load_arch, load_hf_config
from megarl.models.hf.weights_io import load_hf_weights
from megarl.models.megatron.builder import build_model
from megarl.parallel_state import megatron_groups
from megarl.parallel_state.dims import ParallelDims
from megarl.parallel_state.links import WorldLinks
from megarl.resharding import hf_export


def record_receives(receives: list) -> None:
    """Wrap the writer's open_tensors and the world links' exchange (this process only)."""
    opened = []  # the writer's tensors of the current bucket
    open_tensors, exchange = hf_export.HFDirectoryWriter.open_tensors, WorldLinks.exchange

    def recording_open(writer, names):
        tensors = open_tensors(writer, names)
        opened[:] = tensors.values()
        return tensors

    def recording_exchange(links, sends, recvs):
        storages = {t.untyped_storage().data_ptr() for t in opened}
        receives.extend([str(t.device), t.nbytes, t.untyped_storage().data_ptr() in storages]
                        for t, _ in recvs)
        exchange(links, sends, recvs)

    hf_export.HFDirectoryWriter.open_tensors = recording_open
    WorldLinks.exchange = recording_exchange


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--hf-dir", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    world = megatron_groups.init_distributed()
    arch = load_arch(args.hf_dir)
    dims = ParallelDims.for_conversion(world, arch.num_layers)
    megatron_groups.initialize(dims)
    chunks = build_model(arch, dims, perform_initialization=False)
    load_hf_weights(chunks, arch, args.hf_dir)
    receives = []
    record_receives(receives)
    hf_export.export_hf(chunks, arch, load_hf_config(args.hf_dir), args.hf_dir, args.out)
    if megatron_groups.is_rank0():
        print(json.dumps({"layout": dims.describe(), "links_device": str(WorldLinks().device),
                          "receives": receives}))
    megatron_groups.destroy()


if __name__ == "__main__":
    main()
