"""torchrun worker: the converter script's own conversions (scripts/convert.py hf-to-megatron and
megatron-to-hf) and the run's live HF export for several checkpoints in one launch: starting a
launch costs more here than converting a tiny model. Rank 0 prints each job's
line before it runs, so a failure's output names the job, and its notes after it.

  python tests/workers/convert_models.py --jobs '[["hf_to_megatron", IN, OUT], ...]'

Jobs: ["hf_to_megatron", HF, OUT], ["megatron_to_hf", MEGATRON, OUT], and ["export_hf", MEGATRON,
HF, OUT]: the model loaded from MEGATRON exported as the training loop exports it at the end of a
run (megarl.resharding.hf_export), HF being the run's model.hf_dir. ["hf_to_megatron_peak_rss",
HF, OUT] is hf_to_megatron measuring each rank's peak resident memory above what it held before
(its line's `peak_rss`: bytes per rank); "megatron_to_hf_fp8" and "export_hf_fp8" export as
megatron_to_hf and export_hf do, in block FP8 (--dtype fp8, checkpoint.export_dtype=fp8).
"""

import argparse
import functools
import json
import os
import sys

import torch.distributed as dist

from megarl.models.hf.config import arch_from_hf_config
from megarl.models.megatron.builder import build_model
from megarl.models.weights import checkpoint
from megarl.models.weights.convert import hf_to_megatron, megatron_to_hf
from megarl.parallel_state import megatron_groups
from megarl.parallel_state.dims import ParallelDims
from megarl.resharding.hf_export import export_hf


def live_export(megatron_dir: str, hf_dir: str, out_dir: str, export_dtype: str = "auto") -> dict:
    """{"notes": what the export said}."""
    hf_config = checkpoint.read_model_file(megatron_dir)["hf_config"]
    arch = arch_from_hf_config(hf_config)
    dims = ParallelDims.for_conversion(megatron_groups.init_distributed(), arch.num_layers)
    megatron_groups.initialize(dims)
    chunks = build_model(arch, dims, perform_initialization=False)
    checkpoint.load(chunks, megatron_dir)
    notes = []
    export_hf(chunks, arch, hf_config, hf_dir, out_dir, say=notes.append, export_dtype=export_dtype)
    return {"notes": notes}


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        line = next(line for line in f if line.startswith(field + ":"))
    return int(line.split()[1]) * 1024  # kB


def peak_rss_conversion(hf_dir: str, out_dir: str) -> dict:
    """hf_to_megatron; {"notes", "peak_rss": per rank, its peak RSS (VmHWM, file-backed pages of
    the mapped shards included) above its RSS before the conversion}."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS (Linux >= 4.0)
    before = _status_bytes("VmRSS")
    result = hf_to_megatron(hf_dir, out_dir)
    peaks = [None] * dist.get_world_size()
    dist.all_gather_object(peaks, _status_bytes("VmHWM") - before)
    return {"notes": result["notes"], "peak_rss": peaks}


DIRECTIONS = {"hf_to_megatron": hf_to_megatron, "megatron_to_hf": megatron_to_hf, "export_hf": live_export,
              "hf_to_megatron_peak_rss": peak_rss_conversion,
              "megatron_to_hf_fp8": functools.partial(megatron_to_hf, dtype="fp8"),
              "export_hf_fp8": functools.partial(live_export, export_dtype="fp8")}


def _line(rank0: bool, record: dict) -> None:
    """Rank 0 only, text and newline in one write: the ranks share one pipe, and an unbuffered
    print writes the newline apart, so another rank's line could land between them."""
    if rank0:
        sys.stdout.write(json.dumps(record) + "\n")
        sys.stdout.flush()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--jobs", required=True, help="JSON list of [direction, *dirs]")
    args = parser.parse_args()
    # One world for every job: each conversion rebuilds its groups on it (megatron_groups.initialize).
    rank0 = os.environ.get("RANK", "0") == "0"  # torchrun's, known before the first job starts it
    for direction, *dirs in json.loads(args.jobs):
        _line(rank0, {"job": [direction, *dirs]})
        result = DIRECTIONS[direction](*dirs)  # as the script (or the loop) calls it
        _line(rank0, {"done": dirs[-1], **{k: v for k, v in result.items() if k in ("notes", "peak_rss")}})
    megatron_groups.destroy()


if __name__ == "__main__":  # dist_checkpointing's writer processes re-import __main__
    main()
