"""Block-FP8 rollout engines (rollout.quantization: fp8): vLLM builds its linear layers and MoE
experts as Fp8LinearMethod / Fp8MoEMethod with 128 x 128 block scales (codes in float8 e4m3 and
an fp32 `weight_scale_inv` per block, the layout of DeepSeek-V3's and the Qwen3 `-FP8` releases'
checkpoints), every other tensor in the run's dtype; the trainer stays in bf16.

Each sync quantizes every quantized weight exactly as a checkpoint's tensors would be: per
sub-projection of a fused tensor (q, k, v of qkv_proj; gate and up of gate_up_proj and w13; MLA's
q_a and kv_a), each on its own 128-row blocks, as vLLM's loader places a checkpoint's separate
tensors. That equals quantizing the full tensor and slicing it only where every rank's slice holds
whole blocks, which vLLM itself requires at TP > 1 (vllm fp8_utils.validate_fp8_block_shape) and
models/weights/fp8_layout.py checks before any work; so a slab of whole blocks quantizes alike
wherever it is. Who quantizes is the plan's choice, per tensor (resharding/plan.py): where every
slab of it is whole blocks its senders do, and the sync writes their codes and scales into the
load-time tensors (the plan then lists the tensor's scale too); otherwise the sync delivers the
rank's bf16 slice into a staging tensor of the load-time shape and `QuantizedWrites.quantize`
turns it into codes and scales here.
A block-FP8 checkpoint's own quantization_config never decides: with rollout.quantization none
its engine is built unquantized (rollout/vllm/unquantized.py), with fp8 with this module's config.

Owns: the engine arguments, which engine tensors are quantized, the staging and quantization at
sync time. Does not own the quantizer (models/hf/fp8_blocks.py) or the layout rules
(models/weights/fp8_layout.py).
"""

import math
from typing import Collection, Dict, List, Sequence, Set, Tuple

import torch

from megarl.models.hf import fp8_blocks
from megarl.models.hf.config import ModelArch, load_arch
from megarl.models.weights import tables as weight_tables
from megarl.models.weights.destination import RolloutLayout
from megarl.models.weights.fp8_layout import check_fp8_dtype, check_fp8_layout, kept_in_bf16
from megarl.rollout.config import RolloutConfig


def quantization_config(arch: ModelArch, rollout: RolloutLayout) -> dict:
    """The quantization_config the engine is built with, as a published block-FP8 checkpoint of
    this model says it (DeepSeek-V3's, Qwen3's `-FP8`): 128 x 128 blocks, dynamic activations, and
    modules_to_not_convert naming every linear module the format keeps in bf16 (the routers, the
    output layer), which vLLM matches exactly, module by module; and those whose slices at this
    layout are not whole blocks (fp8_layout.kept_in_bf16)."""
    names = [name for entry in weight_tables.entries(arch) for name in entry.hf]
    linear = [name for name in names if name.endswith(".weight") and "embed_tokens" not in name
              and "norm" not in name.rsplit(".", 2)[-2]]
    kept = sorted({name[:-len(".weight")] for name in linear
                   if not fp8_blocks.is_quantized(name, (1, 1), {})} | set(kept_in_bf16(arch, rollout)))
    return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
            "weight_block_size": list(fp8_blocks.BLOCK), "modules_to_not_convert": kept}


def check_quantization(quantization: str) -> None:
    RolloutConfig(quantization)  # refuses unknown ones by name


def engine_kwargs(quantization: str, hf_dir: str, dtype: str, rollout: RolloutLayout, on_gpu: bool) -> dict:
    """LLM() arguments of an engine of this quantization, refusing a layout whose slices are not
    whole blocks (models/weights/fp8_layout.py); on a CPU without vLLM's FP8 kernels (AMX),
    registers megarl's reference kernels first (rollout/vllm/cpu_fp8.py)."""
    check_quantization(quantization)
    if quantization == "none":
        return {}
    arch = load_arch(hf_dir)
    check_fp8_layout(arch, rollout)
    check_fp8_dtype(dtype)
    if not on_gpu:
        from megarl.rollout.vllm import cpu_fp8

        cpu_fp8.register_reference_kernels()
    return dict(quantization="fp8", hf_overrides={"quantization_config": quantization_config(arch, rollout)})


def _scale_attr(param: str) -> str:
    """vLLM's block scale beside a quantized weight: weight -> weight_scale_inv, w13_weight ->
    w13_weight_scale_inv."""
    return param + "_scale_inv"


def _pieces(layer: torch.nn.Module, param: str, rows: int) -> List[int]:
    """Row counts of the sub-projections a checkpoint stores apart, in the order vLLM fuses them."""
    if param == "w13_weight":
        return [rows // 2, rows // 2]
    widths = getattr(layer, "logical_widths", None)
    return list(widths) if widths and sum(widths) == rows else [rows]


def quantize_into(weight: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, pieces: Sequence[int],
                  block: Tuple[int, int]) -> None:
    """Quantize `weight` [..., rows, cols] (leading dims: experts) piece by piece along its rows
    into `codes` (same shape) and `scale` [..., sum ceil(piece/b0), ceil(cols/b1)]."""
    for e in range(math.prod(weight.shape[:-2])):
        w = weight.reshape(-1, *weight.shape[-2:])[e]
        c = codes.view(-1, *codes.shape[-2:])[e]
        s = scale.view(-1, *scale.shape[-2:])[e]
        row, block_row = 0, 0
        for n in pieces:
            q, inv = fp8_blocks.quantize(w[row:row + n], block)
            c[row:row + n] = q
            s[block_row:block_row + inv.shape[0]] = inv
            row, block_row = row + n, block_row + inv.shape[0]


class QuantizedWrites:
    """The FP8 tensors of one vLLM model: `derived` are the scales a sync plans only where the
    senders quantize (`expect` learns which), `target` hands out what the sync writes each
    quantized weight into (its codes, or a staging tensor in the model's dtype) and `quantize`
    fills codes and scales from the staged ones once their module is written."""

    def __init__(self, load_dtypes: Dict[str, torch.dtype], dtype: torch.dtype):
        """`load_dtypes`: every parameter's load-time dtype (plain names); `dtype`: the model's."""
        self.dtype = dtype
        # quantized weight -> its scale (plain names): FP8 at load time, with a block scale beside
        self.quantized = {name: _scale_attr(name) for name, d in load_dtypes.items()
                          if d == fp8_blocks.FP8_DTYPE and _scale_attr(name) in load_dtypes}
        self.derived = set(self.quantized.values())
        self._arriving: Set[str] = set()  # weights whose senders quantize them (their scale planned)
        self._staged: Dict[str, torch.Tensor] = {}

    def expect(self, expected: Collection[str]) -> None:
        """A sync's planned tensors: a quantized weight whose scale is among them arrives as codes
        and scales; every other one is staged and quantized here."""
        self._arriving = {name for name, scale in self.quantized.items() if scale in expected}

    def target(self, name: str, load_time: torch.Tensor) -> torch.Tensor:
        if name not in self.quantized or name in self._arriving:
            return load_time
        self._staged[name] = torch.empty(load_time.shape, dtype=self.dtype, device=load_time.device)
        return self._staged[name]

    def quantize(self, model: torch.nn.Module, real: Dict[str, str], names: Sequence[str]) -> List[str]:
        """Codes and scales of the staged `names` into their load-time tensors; returns the
        scales written."""
        written = []
        for name in names:
            staged = self._staged.pop(name, None)
            if staged is None:
                continue
            module, _, param = real[name].rpartition(".")
            layer = model.get_submodule(module)
            block = tuple(layer.quant_method.quant_config.weight_block_size)
            codes = model.get_parameter(real[name]).data
            scale = model.get_parameter(real[self.quantized[name]]).data
            quantize_into(staged, codes, scale, _pieces(layer, param, staged.shape[-2]), block)
            written.append(self.quantized[name])
        return written
