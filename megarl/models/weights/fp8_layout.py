"""Block-FP8 engine tensors (rollout.quantization fp8): which of a vLLM engine's tensors are FP8,
their bytes, and whether a rollout layout can hold them.

An FP8 engine (rollout/vllm/fp8_engine.py) keeps every linear weight a block-FP8 checkpoint
quantizes (attention and MLP projections, experts; not the embeddings, lm_head, norms or routers)
as 1-byte codes plus one fp32 scale per 128 x 128 block, its sub-projections (q, k, v; gate, up;
MLA's q_a, kv_a) on blocks of their own. vLLM builds such a layer only where every rank's slice
of each sub-projection is whole blocks (vllm fp8_utils.validate_fp8_block_shape and
validate_fp8_block_shape_moe; at TP1 the last sub-projection of a fused layer may end in a partial
block). A dense MLP or shared expert whose slices are not whole blocks stays in the model's dtype
(`kept_in_bf16`: DeepSeek-V3's dense width 18432 and shared width 2048 at rollout TP32 are 576 and
64 per rank; they are 0.5% of its weights); attention or routed experts that are not are refused
(`misaligned`), from the architecture alone, so the planners and the engine refuse before any
work. Pure functions, no vLLM.
"""

import math
from typing import Collection, List, Tuple

from megarl.models.hf import fp8_blocks
from megarl.models.hf.config import ModelArch
from megarl.models.weights import tables as weight_tables
from megarl.models.weights.destination import RolloutLayout, _engine_heads

BLOCK = fp8_blocks.BLOCK
SCALE_BYTES = 4  # fp32 weight_scale_inv
_EXPERT_WEIGHTS = ("w13_weight", "w2_weight")


def kept_in_bf16(arch: ModelArch, rollout: RolloutLayout) -> List[str]:
    """The HF linear modules (gate_proj, up_proj, down_proj) of dense MLPs and shared experts whose
    width per rank at this layout is not whole blocks: the engine keeps them unquantized."""
    kept = []
    for entry in weight_tables.entries(arch):
        for name in entry.hf:
            if ".experts." in name or not name.endswith(("gate_proj.weight", "up_proj.weight",
                                                         "down_proj.weight")):
                continue
            shared = ".shared_expert" in name
            width = arch.shared_expert_ffn if shared else arch.ffn_hidden_size
            if (width // rollout.tp) % BLOCK[0]:
                kept.append(name[:-len(".weight")])
    return kept


def is_fp8(name: str, shape: Tuple[int, ...], kept: Collection[str] = ()) -> bool:
    """Whether the engine tensor `name` (vLLM's name) is block-FP8 in an FP8 engine that keeps the
    HF modules `kept` (kept_in_bf16) unquantized."""
    if name.endswith(_EXPERT_WEIGHTS):
        return True
    module = name[:-len(".weight")].replace("gate_up_proj", "gate_proj")
    return module not in kept and fp8_blocks.is_quantized(name, shape, {})


def scale_count(shape: Tuple[int, ...]) -> int:
    """fp32 scales of an FP8 tensor [..., rows, cols] (leading dims: experts)."""
    return math.prod(shape[:-2]) * -(-shape[-2] // BLOCK[0]) * -(-shape[-1] // BLOCK[1])


def engine_bytes(name: str, shape: Tuple[int, ...], itemsize: int, quantized: bool,
                 kept: Collection[str] = ()) -> int:
    """Bytes the engine holds for one tensor: codes and scales where FP8, else `itemsize` each."""
    if quantized and is_fp8(name, shape, kept):
        return math.prod(shape) + scale_count(shape) * SCALE_BYTES
    return math.prod(shape) * itemsize


def misaligned(arch: ModelArch, rollout: RolloutLayout) -> List[str]:
    """What in this model's attention and routed experts at this engine layout is not whole
    128-row (output) or 128-column (input) blocks per rank; [] when an FP8 engine can hold it."""
    b, tp = BLOCK[0], rollout.tp
    problems = []

    def need(what: str, size: int, always: bool = False) -> None:
        if (tp > 1 or always) and size % b:
            problems.append(f"{what} = {size}")

    if arch.layer_types or arch.family == "gpt_oss":
        return [f"family {arch.family}: FP8 engines are built for dense, MoE and MLA transformers"]
    if arch.mla:
        heads = arch.num_heads // tp
        need("q_b_proj rows per rank", heads * (arch.head_dim + arch.qk_rope_dim))
        need("kv_b_proj rows per rank", heads * (arch.head_dim + arch.v_head_dim))
        need("o_proj columns per rank", heads * arch.v_head_dim)
        if arch.q_lora_rank:
            need("q_lora_rank (fused_qkv_a_proj's first part)", arch.q_lora_rank, always=True)
    else:
        q_heads, kv_heads = _engine_heads(arch, tp, 0)
        need("q rows per rank", len(q_heads) * arch.head_dim, always=True)
        need("k and v rows per rank", len(kv_heads) * arch.head_dim, always=tp == 1)
        need("o_proj columns per rank", len(q_heads) * arch.head_dim)
    if arch.num_experts:
        expert_tp = 1 if rollout.ep > 1 else tp
        need("expert width per rank", arch.moe_ffn_hidden_size // expert_tp, always=True)
    return problems


def check_fp8_layout(arch: ModelArch, rollout: RolloutLayout) -> None:
    problems = misaligned(arch, rollout)
    if problems:
        raise ValueError(f"rollout.quantization='fp8' at rollout tp {rollout.tp}, ep {rollout.ep}: block-FP8 "
                         f"weights need every rank's slice in whole {BLOCK[0]}x{BLOCK[1]} blocks (vLLM "
                         f"requires it), but {'; '.join(problems)}. Choose a rollout tp that keeps them "
                         "multiples of 128, or rollout.quantization 'none'")


def check_fp8_dtype(dtype: str) -> None:
    if dtype not in ("bfloat16", "float16"):
        raise ValueError(f"rollout.quantization='fp8' with a model dtype {dtype!r}: vLLM's FP8 layers "
                         "compute in bfloat16 or float16; use a bfloat16 checkpoint (its config.json "
                         "torch_dtype) or rollout.quantization 'none'")
