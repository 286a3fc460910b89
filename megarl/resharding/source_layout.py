"""What every rank of a training layout holds, as resharding Pieces, computed without a model.

Owns the arithmetic that mirrors, for megarl's models, what `metadata.all_pieces(
metadata.local_pieces(chunks, arch, rank)[0], links)` reports in a live run: Megatron-Core's rank order
(its default "tp-cp-ep-dp-pp": TP ranks vary fastest, pipeline stages slowest; experts fold
expert-TP x EP x expert-DP x PP over the same ranks), megarl's even split of the layers over
pipeline stages and virtual stages (interleaved: chunk c = vp_stage * pp + pp_rank holds the c-th
run of num_layers / (pp * vpp) layers), which stage holds the embedding (the first), the final
norm and the output layer (the last; a tied output layer is the embedding's copy and is left out
as local_pieces leaves it out), and each tensor's local shape, padded vocabulary included. Pure:
no process group, no model, no torch.distributed; a 671B layout takes seconds.
"""

import functools
import re
import warnings
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

from megarl.models.hf.config import DTYPES, ModelArch
from megarl.models.megatron.config import padded_vocab_size, transformer_config
from megarl.models.weights import tables as weight_tables
from megarl.parallel_state.dims import ParallelDims
from megarl.resharding.plan import Piece
from megarl.resharding.source_layout_hybrid import hybrid_sections, hybrid_shapes

_NUMBERS = re.compile(r"^decoder\.layers\.(\d+)\.(?:mlp\.experts\.local_experts\.(\d+)\.)?")
_DTYPE_NAMES = {str(dtype): str(dtype) for dtype in DTYPES.values()}
_DTYPE_NAMES.update({name: str(dtype) for name, dtype in DTYPES.items()})


# Megatron keeps the router's expert bias in fp32 whatever the model's dtype.
_FP32_SUFFIX, _FP32 = "router.expert_bias", "torch.float32"


@dataclass(frozen=True)
class _Tensor:
    """One tensor of the full model as the ranks of its pipeline stage (and EP rank) hold it."""
    canonical: str
    stage: int             # the pipeline rank holding it
    expert: Optional[int]  # global expert id; None: not an expert's tensor
    tp_dim: Optional[int]  # dimension cut over the (expert-)TP group when it has > 1 rank
    glu: bool
    shape: Tuple[int, ...]  # local shape


def _shapes(arch: ModelArch, dims: ParallelDims, role: str,
            ) -> Dict[str, Tuple[Tuple[int, ...], Optional[int], bool]]:
    """(local shape, TP dimension, glu) of each tensor, by its name after the layer prefix
    ("expert." + the name after an expert's prefix). Shapes are Megatron-Core's: QKV fuses
    (heads + 2 * query groups) * head_dim rows, SwiGLU fc1 stacks gate and up, the vocabulary
    is padded so that every TP shard has the same width; the value model's head is replicated."""
    hidden, head_dim, tp, etp = arch.hidden_size, arch.head_dim, dims.tp, dims.expert_tp
    qkv_rows = (arch.num_heads + 2 * arch.num_kv_heads) * head_dim
    vocab = padded_vocab_size(arch.vocab_size, tp)
    shapes = {
        "embedding.word_embeddings.weight": ((vocab // tp, hidden), 0, False),
        "output_layer.weight": ((1, hidden), None, False) if role == "value"
        else ((vocab // tp, hidden), 0, False),
        "decoder.final_layernorm.weight": ((hidden,), None, False),
        "input_layernorm.weight": ((hidden,), None, False),
        "pre_mlp_layernorm.weight": ((hidden,), None, False),
        "self_attention.linear_qkv.weight": ((qkv_rows // tp, hidden), 0, False),
        "self_attention.linear_qkv.bias": ((qkv_rows // tp,), 0, False),
        "self_attention.q_layernorm.weight": ((head_dim,), None, False),
        "self_attention.k_layernorm.weight": ((head_dim,), None, False),
        "self_attention.linear_proj.weight": ((hidden, arch.num_heads * head_dim // tp), 1, False),
        "mlp.linear_fc1.weight": ((2 * arch.ffn_hidden_size // tp, hidden), 0, True),
        "mlp.linear_fc2.weight": ((hidden, arch.ffn_hidden_size // tp), 1, False),
        "mlp.router.weight": ((arch.num_experts, hidden), None, False),
        "expert.linear_fc1.weight": ((2 * arch.moe_ffn_hidden_size // etp, hidden), 0, True),
        "expert.linear_fc2.weight": ((hidden, arch.moe_ffn_hidden_size // etp), 1, False),
        # DeepSeek-style MoE layers: the router's fp32 expert bias and the shared experts.
        "mlp.router.expert_bias": ((arch.num_experts,), None, False),
        "mlp.shared_experts.linear_fc1.weight": ((2 * arch.shared_expert_ffn // tp, hidden), 0, True),
        "mlp.shared_experts.linear_fc2.weight": ((hidden, arch.shared_expert_ffn // tp), 1, False),
    }
    if arch.mla:
        shapes.update(_mla_shapes(arch, tp))
    if arch.layer_types:
        shapes.update(hybrid_shapes(arch, tp))
    if arch.linear_bias or arch.attention_sinks:  # gpt-oss (experts' biases need etp 1)
        shapes.update({
            "self_attention.linear_proj.bias": ((hidden,), None, False),
            "self_attention.core_attention.softmax_offset": ((arch.num_heads // tp,), 0, False),
            "mlp.router.bias": ((arch.num_experts,), None, False),
            "expert.linear_fc1.bias": ((2 * arch.moe_ffn_hidden_size,), None, False),
            "expert.linear_fc2.bias": ((hidden,), None, False),
        })
    return shapes


def _mla_shapes(arch: ModelArch, tp: int) -> Dict[str, Tuple[Tuple[int, ...], Optional[int], bool]]:
    """Multi-latent attention: replicated down projections and latent norms, head-split
    up projections, the output projection over the heads' value dims."""
    hidden, heads, rope = arch.hidden_size, arch.num_heads, arch.qk_rope_dim
    q_rows, kv_rows = heads * (arch.head_dim + rope), heads * (arch.head_dim + arch.v_head_dim)
    return {
        "self_attention.linear_q_down_proj.weight": ((arch.q_lora_rank, hidden), None, False),
        "self_attention.q_layernorm.weight": ((arch.q_lora_rank,), None, False),
        "self_attention.linear_q_up_proj.weight": ((q_rows // tp, arch.q_lora_rank), 0, False),
        "self_attention.linear_q_proj.weight": ((q_rows // tp, hidden), 0, False),
        "self_attention.linear_kv_down_proj.weight": ((arch.kv_lora_rank + rope, hidden), None, False),
        "self_attention.kv_layernorm.weight": ((arch.kv_lora_rank,), None, False),
        "self_attention.linear_kv_up_proj.weight": ((kv_rows // tp, arch.kv_lora_rank), 0, False),
        "self_attention.linear_proj.weight": ((hidden, heads * arch.v_head_dim // tp), 1, False),
    }


def _stage_of_layers(arch: ModelArch, dims: ParallelDims) -> List[int]:
    """The pipeline rank building each layer (uneven stages go without VPP)."""
    return [chunk % dims.pp for chunk, layers in enumerate(dims.chunk_layers(arch.num_layers))
            for _ in layers]


def _tensors(arch: ModelArch, dims: ParallelDims, role: str) -> List[_Tensor]:
    """Every tensor of the full model in weight_tables.entries order: its stage, its local shape.
    The embedding is on the first stage, a layer's tensors on its stage, the rest (final norm,
    output layer) on the last."""
    shapes = _shapes(arch, dims, role)
    stage_of_layer = _stage_of_layers(arch, dims)
    out = []
    for entry in weight_tables.entries(arch, role):
        name = entry.megatron
        match = _NUMBERS.match(name)
        expert = None
        if match is None:
            stage = 0 if name == "embedding.word_embeddings.weight" else dims.pp - 1
            suffix = name
        else:
            stage = stage_of_layer[int(match.group(1))]
            expert = None if match.group(2) is None else int(match.group(2))
            suffix = ("expert." if expert is not None else "") + name[match.end():]
        if suffix not in shapes:
            raise KeyError(f"source_layout has no shape for Megatron tensor {name!r}: add its "
                           "weight-table row to _shapes in megarl/resharding/source_layout.py")
        shape, tp_dim, glu = shapes[suffix]
        sharded = (dims.expert_tp if expert is not None else dims.tp) > 1
        out.append(_Tensor(name, stage, expert, tp_dim if sharded else None, glu, shape))
    return out


@dataclass(frozen=True)
class RankCoords:
    """One global rank's place on every axis, as Megatron-Core's RankGenerators assign them."""
    rank: int
    tp: int
    cp: int
    dp: int
    pp: int
    ep: int
    etp: int
    edp: int


def rank_coords(dims: ParallelDims, rank: int) -> RankCoords:
    """Megatron-Core's default order "tp-cp-ep-dp-pp" (megarl passes no other): dense ranks are
    tp + TP * (cp + CP * (dp + DP * pp)) (its dense generator has ep = 1), expert ranks
    etp + ETP * (ep + EP * (edp + EDP * pp)) (its expert generator has cp = 1)."""
    if not 0 <= rank < dims.world_size:
        raise ValueError(f"rank {rank} is outside world size {dims.world_size}")
    tp, rest = rank % dims.tp, rank // dims.tp
    cp, rest = rest % dims.cp, rest // dims.cp
    dp, pp = rest % dims.dp, rest // dims.dp
    etp, rest = rank % dims.expert_tp, rank // dims.expert_tp
    ep, rest = rest % dims.ep, rest // dims.ep
    edp, epp = rest % dims.expert_dp, rest // dims.expert_dp
    assert epp == pp, (rank, dims)  # Megatron asserts both generators agree on the PP groups
    return RankCoords(rank, tp, cp, dp, pp, ep, etp, edp)


def _normalize_dtype(dtype: Optional[str], arch: ModelArch) -> str:
    if dtype is None:
        return str(arch.torch_dtype)
    if dtype not in _DTYPE_NAMES:
        raise ValueError(f"dtype {dtype!r} is not one megarl trains in: use one of "
                         f"{sorted(set(_DTYPE_NAMES.values()))}")
    return _DTYPE_NAMES[dtype]


def check_layout(arch: ModelArch, dims: ParallelDims) -> None:
    """Raise ValueError naming the values if megarl cannot build `arch` at `dims`: the checks
    the preflight and build_model apply (ParallelDims.check_model, then Megatron-Core's own
    TransformerConfig checks; a config is made, no model)."""
    with warnings.catch_warnings():  # Megatron's deprecation notes concern running the config
        warnings.simplefilter("ignore")
        transformer_config(arch, dims)


@functools.lru_cache(maxsize=16)
def layout_pieces(arch: ModelArch, dims: ParallelDims, dtype: Optional[str] = None,
                  role: str = "policy") -> Tuple[Piece, ...]:
    """Every rank's pieces in layout `dims`, by rank, then in weight_tables.entries order: the
    set metadata.all_pieces(metadata.local_pieces(chunks, arch, rank, role)[0], links) gathers in a live run
    (its order within a rank is the model's parameter order). `dtype` is the parameters' dtype
    as Piece spells it ("torch.bfloat16", or "bfloat16"); None: the model's (arch.dtype), which
    is what build_model uses."""
    if role not in ("policy", "value"):
        raise ValueError(f"role {role!r} is not one of ('policy', 'value')")
    check_layout(arch, dims)
    dtype = _normalize_dtype(dtype, arch)
    experts_per_rank = arch.num_experts // dims.ep if arch.num_experts else 0
    # Each (pipeline rank, EP rank)'s tensors, in entries order: built once, shared by its ranks.
    held: Dict[Tuple[int, int], list] = {(p, e): [] for p in range(dims.pp) for e in range(dims.ep)}
    parts = hybrid_sections(arch) if arch.layer_types else {}
    for t in _tensors(arch, dims, role):
        ep_ranks = range(dims.ep) if t.expert is None else (t.expert // experts_per_rank,)
        sections = next((s for suffix, s in parts.items() if t.canonical.endswith(suffix)), ())
        for ep in ep_ranks:
            held[(t.stage, ep)].append((t.canonical, t.expert is not None, t.tp_dim, t.glu, t.shape,
                                        sections))
    pieces = []
    for rank in range(dims.world_size):  # a million pieces at 1024 ranks: keep this loop lean
        at = rank_coords(dims, rank)
        dense, expert = (at.tp, dims.tp), (at.etp, dims.expert_tp)
        for canonical, is_expert, tp_dim, glu, shape, sections in held[(at.pp, at.ep)]:
            tp_rank, tp_size = expert if is_expert else dense
            pieces.append(Piece(rank, canonical, tp_rank, tp_size, tp_dim, glu, shape,
                                _FP32 if canonical.endswith(_FP32_SUFFIX) else dtype, sections))
    return tuple(pieces)
