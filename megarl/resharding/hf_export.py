"""Export a live model (any TP/PP/EP layout) as an HF checkpoint, streaming.

The export is a weight sync into files: `HFDirectoryWriter` takes the place of the rollout engine
in megarl.resharding.sync_weights with the "hf" layout (rank 0 holds every HF tensor whole), so
the same plan and transport bring each bucket's tensors to rank 0, which writes them as one
safetensors file.
The transport writes only into tensors on the sync's Links' device (NCCL takes no CPU tensor;
gloo does, so a CPU run would not show it: transport.py), so the writer opens each bucket's
tensors on that device, as an engine's are, and copies them to the host when the bucket closes,
to write its file. Memory: one bucket on the device (the plan's bound, plan.peak_bound, which the
memory planner books for the export) and, while its file is written, on the host; never the
whole model. Staging in the transport instead would let it take off-device targets again.
Writes into OUT.partial and renames it when the index, config and tokenizer files (and the
untrained MTP layers, copied from the source checkpoint: models/weights/mtp.py) are in place; MTP
layers the source declares but lacks stay absent, and the export says so through `say`.
With dtype "fp8" each bucket is quantized to block FP8 on rank 0 before its file is written
(models/hf/fp8_blocks.py; a bucket holds whole tensors), and config.json carries the
quantization_config; otherwise the weights are written in the model's dtype, and config.json
without the source's quantization_config.
Does not own the Megatron-checkpoint path (convert.py) or choosing when to export (the loop).
"""

import json
import os
import shutil
import sys
from typing import Callable, Dict, List, Sequence, Tuple

import torch
import torch.distributed as dist
from safetensors.torch import save_file

from megarl.models.hf import fp8_blocks
from megarl.models.hf.config import ModelArch
from megarl.models.hf.fused_experts import export_config, fuse
from megarl.models.hf.tokenizer_files import TOKENIZER_ASSETS
from megarl.models.weights import mtp as mtp_weights
from megarl.models.weights import tables as weight_tables
from megarl.parallel_state.links import Links, WorldLinks
from megarl.resharding.sync import sync_weights
from megarl.rollout.engine import WeightLayout, WeightUpdateReport

_FP32_TENSORS = fp8_blocks.KEPT_IN_FP32


class HFDirectoryWriter:
    """The RolloutEngine surface sync_weights uses, writing HF files instead of loading them;
    `links`: the sync's (its rank 0 writes; its device holds the received tensors); `export_dtype`:
    auto (the model's dtype) or fp8 (block FP8)."""

    def __init__(self, out_dir: str, hf_config: dict, assets_dir: str, dtype: torch.dtype,
                 arch: ModelArch, say: Callable[[str], None], links: Links, export_dtype: str = "auto"):
        self.out_dir, self.hf_config, self.assets_dir, self.dtype = out_dir, hf_config, assets_dir, dtype
        self.arch, self.say, self.links = arch, say, links
        # fp8: each bucket (and the MTP layers) quantized on rank 0 before its file is written
        self.quantize = (fp8_blocks.quantizer(hf_config.get("quantization_config")) if export_dtype == "fp8"
                         else None)
        self.partial = out_dir.rstrip("/") + ".partial"
        self.writer = links.rank == 0
        self.weight_map = {}

    def weight_layout(self) -> WeightLayout:
        return WeightLayout("hf", self.links.size)

    def begin_weight_update(self, expected: Dict[str, Tuple[int, ...]]) -> None:
        self.expected, self.open = expected, {}
        if self.writer:
            shutil.rmtree(self.partial, ignore_errors=True)
            os.makedirs(self.partial)

    def open_tensors(self, names: Sequence[str]) -> Dict[str, torch.Tensor]:
        self.open = {name: torch.empty(self.expected[name], dtype=torch.float32 if name.endswith(
            _FP32_TENSORS) else self.dtype, device=self.links.device) for name in names}
        return self.open

    def close_tensors(self, names: Sequence[str]) -> None:
        if not names:
            return
        filename = f"model-{len(set(self.weight_map.values())) + 1:05d}.safetensors"
        # Popped: each device tensor is freed as soon as its host copy exists.
        host = self._as_hf({name: self.open.pop(name).cpu() for name in names})
        if self.quantize:
            host = self.quantize(host)
        save_file(host, os.path.join(self.partial, filename), metadata={"format": "pt"})
        self.weight_map.update({name: filename for name in host})

    def _as_hf(self, tensors: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        """Experts a checkpoint fuses (gpt-oss: NAME[e], planned in Megatron's orientation, as
        regions copy rows and cannot transpose) -> the checkpoint's fused tensors. A bucket holds
        whole modules, so all experts of a layer close together."""
        if not any("[" in name for name in tensors):
            return tensors
        sliced = {h: entry for entry in weight_tables.entries(self.arch) for h in entry.hf
                  if "[" in h and h in tensors}
        out = {}
        for name, tensor in tensors.items():
            out.update(weight_tables.to_hf(self.arch, sliced[name], tensor) if name in sliced
                       else {name: tensor})
        return fuse(out)

    def finish_weight_update(self) -> WeightUpdateReport:
        # The plan refuses to run unless it covers every tensor the architecture has, so what
        # was written is complete by construction.
        if self.writer:
            mtp = mtp_weights.restore(self.arch, self.assets_dir, self.partial, self.quantize)
            for note in mtp_weights.absent_notes(self.arch, len(mtp), self.assets_dir):
                self.say(f"megarl: HF export {self.out_dir}: {note}")
            self.weight_map.update(mtp)
            total = sum(os.path.getsize(os.path.join(self.partial, f)) for f in set(self.weight_map.values()))
            with open(os.path.join(self.partial, "model.safetensors.index.json"), "w") as f:
                json.dump({"metadata": {"total_size": total}, "weight_map": self.weight_map}, f,
                          indent=2, sort_keys=True)
            config = (fp8_blocks.export_config(self.hf_config, self.weight_map) if self.quantize
                      else export_config(self.hf_config, mxfp4=False))
            with open(os.path.join(self.partial, "config.json"), "w") as f:
                json.dump(config, f, indent=2)
            for name in TOKENIZER_ASSETS:
                if os.path.isfile(os.path.join(self.assets_dir, name)):
                    shutil.copy2(os.path.join(self.assets_dir, name), self.partial)
            shutil.rmtree(self.out_dir, ignore_errors=True)
            os.rename(self.partial, self.out_dir)
        written = len(self.weight_map)
        return WeightUpdateReport(params_expected=written, params_loaded=written)


def _to_stderr(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def export_hf(chunks: List[torch.nn.Module], arch: ModelArch, hf_config: dict, tokenizer_dir: str,
              out_dir: str, say: Callable[[str], None] = _to_stderr, export_dtype: str = "auto") -> str:
    """Collective: write the model held by `chunks` to `out_dir` in HF format, its weights in the
    model's dtype or block FP8 (`export_dtype` auto | fp8); `tokenizer_dir` (the source HF
    checkpoint) also gives the MTP layers. Rank 0 passes its notes to `say` (the run's console in
    the loop)."""
    weight_tables.check_export_dtype(arch.family, export_dtype, "export dtype")
    dtype = next(chunks[0].parameters()).dtype
    links = WorldLinks()
    writer = HFDirectoryWriter(out_dir, hf_config, tokenizer_dir, dtype, arch, say, links, export_dtype)
    sync_weights(chunks, arch, writer, links=links)
    dist.barrier()
    return out_dir
