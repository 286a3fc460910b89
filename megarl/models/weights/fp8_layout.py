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
work.

Who quantizes (`sender_quantizes`): the rows of a fused tensor's sub-projections start on block
boundaries (the checks above; only the last may end in a partial block), so an FP8 engine tensor's
blocks are those of one grid from its first row and column, and a slab of it along a dimension
whose edges lie on that grid holds every row and column of each block it touches. The rank that
sends such a slab quantizes it and sends 1-byte codes and fp32 scales (1 + 4/16384 bytes a weight
against 2); a slab whose edge cuts a block (TP shards not aligned to 128 rows, heads of 64 rows
read apart) leaves its tensor to the receiving engine rank, which gathers the whole tensor in the
model's dtype and quantizes it there. Pure functions, no vLLM.
"""

import dataclasses
import math
from typing import Collection, Dict, List, Tuple

from megarl.models.hf import fp8_blocks
from megarl.models.hf.config import ModelArch
from megarl.models.weights import tables as weight_tables
from megarl.models.weights.destination import DestTensor, RolloutLayout, _engine_heads

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


def scale_shape(shape: Tuple[int, ...]) -> Tuple[int, ...]:
    """The weight_scale_inv beside an FP8 tensor [..., rows, cols] (leading dims: experts)."""
    return (*shape[:-2], *fp8_blocks.scale_shape(shape[-2:], BLOCK))


def scale_count(shape: Tuple[int, ...]) -> int:
    """fp32 scales of an FP8 tensor [..., rows, cols] (leading dims: experts)."""
    return math.prod(scale_shape(shape))


def quantized_layout(arch: ModelArch, rollout: RolloutLayout, layout: Dict[int, Tuple[DestTensor, ...]]
                     ) -> Dict[int, Tuple[DestTensor, ...]]:
    """Every rank's destination tensors of an FP8 engine (destination.vllm_layout's), those it
    holds in block FP8 marked `fp8`; refuses a layout whose slices are not whole blocks."""
    check_fp8_layout(arch, rollout)
    kept = set(kept_in_bf16(arch, rollout))
    marked: Dict[int, Tuple[DestTensor, ...]] = {}  # by id: ranks at one engine position share a tuple
    return {rank: marked.setdefault(id(tensors), tuple(
        dataclasses.replace(t, fp8=True) if is_fp8(t.name, t.shape, kept) else t for t in tensors))
        for rank, tensors in layout.items()}


# Sources the sender quantizes as they are: the engine's dtype (the trainer and the engine both
# run in the model's: check_fp8_dtype). A wider (fp32) source quantized as it is would give other
# codes than the engine's quantizing of its own rounded copy: it keeps the receiver's path.
SENDER_DTYPES = ("torch.bfloat16", "torch.float16")


def sender_quantizes(tensor: DestTensor, dim: int, start: int, length: int) -> bool:
    """Whether the slab [start, start + length) along `dim` of FP8 tensor `tensor` (every row or
    column of its other dimension; of one expert for fused experts) is whole blocks: its edges on
    the block grid, the last block of a dimension partial."""
    size = tensor.shape[-2:][dim]
    end = start + length
    return start % BLOCK[dim] == 0 and (end % BLOCK[dim] == 0 or end == size)


def slab_scales(dim: int, start: int, length: int) -> Tuple[int, int]:
    """(first block, blocks) of a whole-blocks slab along `dim`: where its scales go."""
    return start // BLOCK[dim], -(-length // BLOCK[dim])


def sent_bytes(numel: int, dim: int, length: int) -> int:
    """Bytes of a sender-quantized 2-D slab of `numel` elements, `length` along `dim`: its codes
    and its blocks' fp32 scales."""
    return numel + -(-length // BLOCK[dim]) * -(-(numel // length) // BLOCK[1 - dim]) * SCALE_BYTES


def engine_bytes(tensor: DestTensor, itemsize: int, quantized: bool, kept: Collection[str] = ()) -> int:
    """Bytes the engine holds for one tensor: codes and scales where FP8, else as
    DestTensor.engine_bytes (`itemsize` the model dtype's, 4 where the engine holds it in fp32)."""
    if quantized and is_fp8(tensor.name, tensor.shape, kept):
        return tensor.numel + scale_count(tensor.shape) * SCALE_BYTES
    return tensor.engine_bytes(itemsize)


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
