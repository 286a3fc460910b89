"""HF <-> Megatron weight names: one table per model family, plus the glue that applies them.

Megatron names here are the canonical full-model names of megarl's layer spec at TP=PP=EP=1:
global layer ids and global expert ids (see `param_layout.py` for local -> canonical). Each row
names one Megatron tensor, the HF tensors it is made of, and the named transform between them.
"""

import dataclasses
import re
from dataclasses import dataclass
from typing import Callable, Dict, Iterator, List, Tuple

import torch

from megarl.models.hf.config import HYBRIDS, ModelArch
from megarl.models.hf.fused_experts import sliced
from megarl.models.megatron.config import padded_vocab_size
from megarl.models.weights import transforms as wt

LAYER = "decoder.layers.{layer}."
EXPERT = LAYER + "mlp.experts.local_experts.{expert}."


@dataclass(frozen=True)
class Row:
    megatron: str
    hf: Tuple[str, ...]
    # copy | qkv | gated_qkv | qkvzba | qkv_z_b_a | gate_up | vocab | gate_up_interleaved | transpose
    transform: str = "copy"
    when: str = "always"     # always | untied | qkv_bias | qk_norm | q_lora | no_q_lora | sinks
    layers: str = "all"      # all | dense | moe | linear | full: which layers have it (DeepSeek's
    #                          first are dense; a hybrid's linear- or full-attention layers)


_EMBED = Row("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), "vocab")
_FINAL = [
    Row("decoder.final_layernorm.weight", ("model.norm.weight",)),
    Row("output_layer.weight", ("lm_head.weight",), "vocab", when="untied"),
]
_ATTENTION = [
    Row(LAYER + "input_layernorm.weight", ("model.layers.{layer}.input_layernorm.weight",)),
    Row(LAYER + "self_attention.linear_qkv.weight",
        tuple(f"model.layers.{{layer}}.self_attn.{p}_proj.weight" for p in "qkv"), "qkv"),
    Row(LAYER + "self_attention.linear_qkv.bias",
        tuple(f"model.layers.{{layer}}.self_attn.{p}_proj.bias" for p in "qkv"), "qkv",
        when="qkv_bias"),
    Row(LAYER + "self_attention.q_layernorm.weight", ("model.layers.{layer}.self_attn.q_norm.weight",),
        when="qk_norm"),
    Row(LAYER + "self_attention.k_layernorm.weight", ("model.layers.{layer}.self_attn.k_norm.weight",),
        when="qk_norm"),
    Row(LAYER + "self_attention.linear_proj.weight", ("model.layers.{layer}.self_attn.o_proj.weight",)),
    Row(LAYER + "pre_mlp_layernorm.weight", ("model.layers.{layer}.post_attention_layernorm.weight",)),
]
_ATTN = "model.layers.{layer}.self_attn."
# DeepSeek's multi-latent attention: low-rank q (or one q_proj), the joint KV latent with the
# shared RoPE key, and their norms. The row layouts of HF and Megatron agree (per head
# [no-RoPE dims, RoPE dims] in q, [k no-RoPE, v] in kv_b), so every row copies.
_MLA_ATTENTION = [
    Row(LAYER + "input_layernorm.weight", ("model.layers.{layer}.input_layernorm.weight",)),
    Row(LAYER + "self_attention.linear_q_down_proj.weight", (_ATTN + "q_a_proj.weight",), when="q_lora"),
    Row(LAYER + "self_attention.q_layernorm.weight", (_ATTN + "q_a_layernorm.weight",), when="q_lora"),
    Row(LAYER + "self_attention.linear_q_up_proj.weight", (_ATTN + "q_b_proj.weight",), when="q_lora"),
    Row(LAYER + "self_attention.linear_q_proj.weight", (_ATTN + "q_proj.weight",), when="no_q_lora"),
    Row(LAYER + "self_attention.linear_kv_down_proj.weight", (_ATTN + "kv_a_proj_with_mqa.weight",)),
    Row(LAYER + "self_attention.kv_layernorm.weight", (_ATTN + "kv_a_layernorm.weight",)),
    Row(LAYER + "self_attention.linear_kv_up_proj.weight", (_ATTN + "kv_b_proj.weight",)),
    Row(LAYER + "self_attention.linear_proj.weight", (_ATTN + "o_proj.weight",)),
    Row(LAYER + "pre_mlp_layernorm.weight", ("model.layers.{layer}.post_attention_layernorm.weight",)),
]
_DENSE_MLP = [
    Row(LAYER + "mlp.linear_fc1.weight", ("model.layers.{layer}.mlp.gate_proj.weight",
                                          "model.layers.{layer}.mlp.up_proj.weight"), "gate_up",
        layers="dense"),
    Row(LAYER + "mlp.linear_fc2.weight", ("model.layers.{layer}.mlp.down_proj.weight",),
        layers="dense"),
]
_EXPERTS = [
    Row(EXPERT + "linear_fc1.weight", ("model.layers.{layer}.mlp.experts.{expert}.gate_proj.weight",
                                       "model.layers.{layer}.mlp.experts.{expert}.up_proj.weight"),
        "gate_up", layers="moe"),
    Row(EXPERT + "linear_fc2.weight", ("model.layers.{layer}.mlp.experts.{expert}.down_proj.weight",),
        layers="moe"),
]
_ROUTER = Row(LAYER + "mlp.router.weight", ("model.layers.{layer}.mlp.gate.weight",), layers="moe")
_QWEN3_MOE_MLP = [_ROUTER, *_EXPERTS]
# DeepSeek-style MoE layers: the router's expert bias (a buffer in both, trained by token
# counts) and the shared experts beside the routed ones.
_DEEPSEEK_MOE_MLP = [
    _ROUTER,
    Row(LAYER + "mlp.router.expert_bias", ("model.layers.{layer}.mlp.gate.e_score_correction_bias",),
        layers="moe"),
    Row(LAYER + "mlp.shared_experts.linear_fc1.weight",
        ("model.layers.{layer}.mlp.shared_experts.gate_proj.weight",
         "model.layers.{layer}.mlp.shared_experts.up_proj.weight"), "gate_up", layers="moe"),
    Row(LAYER + "mlp.shared_experts.linear_fc2.weight",
        ("model.layers.{layer}.mlp.shared_experts.down_proj.weight",), layers="moe"),
    *_EXPERTS,
]
_MIXTRAL_MLP = [
    Row(LAYER + "mlp.router.weight", ("model.layers.{layer}.block_sparse_moe.gate.weight",),
        layers="moe"),
    Row(EXPERT + "linear_fc1.weight", ("model.layers.{layer}.block_sparse_moe.experts.{expert}.w1.weight",
                                       "model.layers.{layer}.block_sparse_moe.experts.{expert}.w3.weight"),
        "gate_up", layers="moe"),
    Row(EXPERT + "linear_fc2.weight",
        ("model.layers.{layer}.block_sparse_moe.experts.{expert}.w2.weight",), layers="moe"),
]
# gpt-oss: biased q/k/v/o, a sink logit per head, a biased router, and all experts of a layer in
# fused tensors (x @ W layout, gate and up columns interleaved); NAME[e] is expert e's slice
# (models/hf/fused_experts.py).
_GPT_OSS_EXPERTS = "model.layers.{layer}.mlp.experts."
_GPT_OSS = [
    *_ATTENTION,
    Row(LAYER + "self_attention.linear_proj.bias", (_ATTN + "o_proj.bias",)),
    Row(LAYER + "self_attention.core_attention.softmax_offset", (_ATTN + "sinks",), when="sinks"),
    Row(LAYER + "mlp.router.weight", ("model.layers.{layer}.mlp.router.weight",), layers="moe"),
    Row(LAYER + "mlp.router.bias", ("model.layers.{layer}.mlp.router.bias",), layers="moe"),
    Row(EXPERT + "linear_fc1.weight", (sliced(_GPT_OSS_EXPERTS + "gate_up_proj", "{expert}"),),
        "gate_up_interleaved", layers="moe"),
    Row(EXPERT + "linear_fc1.bias", (sliced(_GPT_OSS_EXPERTS + "gate_up_proj_bias", "{expert}"),),
        "gate_up_interleaved", layers="moe"),
    Row(EXPERT + "linear_fc2.weight", (sliced(_GPT_OSS_EXPERTS + "down_proj", "{expert}"),),
        "transpose", layers="moe"),
    Row(EXPERT + "linear_fc2.bias", (sliced(_GPT_OSS_EXPERTS + "down_proj_bias", "{expert}"),),
        layers="moe"),
]
# The fused expert tensors of gpt-oss checkpoints (models/hf/fused_experts.FusedExpertsReader).
FUSED_EXPERTS = {"gpt_oss": ("mlp.experts.gate_up_proj", "mlp.experts.gate_up_proj_bias",
                             "mlp.experts.down_proj", "mlp.experts.down_proj_bias")}
# Those an export may write as MXFP4 blocks and scales (scripts/convert.py --experts mxfp4).
MXFP4_EXPERTS = {"gpt_oss": ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")}
# The dtypes an HF export writes its weights in: the model's, or block FP8 (models/hf/fp8_blocks.py).
EXPORT_DTYPES = ("auto", "fp8")
# Families without a block-FP8 export: gpt-oss is published with MXFP4 experts in fused 3-D
# tensors, which block FP8 does not cover (its export is --experts mxfp4), and the hybrids'
# linear-attention layers have no block-FP8 layout checked against vLLM and transformers here.
NO_FP8_EXPORT = ("gpt_oss", *HYBRIDS)


def check_export_dtype(family: str, dtype: str, what: str) -> None:
    """Refuse an export dtype the family cannot be written in, naming `what` set it."""
    if dtype not in EXPORT_DTYPES:
        raise ValueError(f"{what} {dtype!r}: expected one of {list(EXPORT_DTYPES)}")
    if dtype == "fp8" and family in NO_FP8_EXPORT:
        advice = ("export in the model's dtype (auto), or its experts as MXFP4 as published "
                  "(scripts/convert.py megatron-to-hf --experts mxfp4)" if family == "gpt_oss"
                  else "export in the model's dtype (auto)")
        raise ValueError(f"{what} fp8: {family} has no block-FP8 export; {advice}")

_LINEAR = "model.layers.{layer}.linear_attn."
# Gated DeltaNet hybrids (Qwen3-Next): linear attention in most layers, gated full attention in
# the others; Qwen3-MoE's routed experts with a gated shared expert beside them.
_HYBRID_ATTENTION = [
    Row(LAYER + "input_layernorm.weight", ("model.layers.{layer}.input_layernorm.weight",)),
    Row(LAYER + "self_attention.in_proj.weight", (_LINEAR + "in_proj_qkvz.weight",
                                                  _LINEAR + "in_proj_ba.weight"), "qkvzba",
        layers="linear"),
    Row(LAYER + "self_attention.conv1d.weight", (_LINEAR + "conv1d.weight",), layers="linear"),
    Row(LAYER + "self_attention.dt_bias", (_LINEAR + "dt_bias",), layers="linear"),
    Row(LAYER + "self_attention.A_log", (_LINEAR + "A_log",), layers="linear"),
    Row(LAYER + "self_attention.out_norm.weight", (_LINEAR + "norm.weight",), layers="linear"),
    Row(LAYER + "self_attention.out_proj.weight", (_LINEAR + "out_proj.weight",), layers="linear"),
    Row(LAYER + "self_attention.linear_qkv.weight",
        tuple(f"model.layers.{{layer}}.self_attn.{p}_proj.weight" for p in "qkv"), "gated_qkv",
        layers="full"),
    Row(LAYER + "self_attention.q_layernorm.weight", (_ATTN + "q_norm.weight",), layers="full"),
    Row(LAYER + "self_attention.k_layernorm.weight", (_ATTN + "k_norm.weight",), layers="full"),
    Row(LAYER + "self_attention.linear_proj.weight", (_ATTN + "o_proj.weight",), layers="full"),
    Row(LAYER + "pre_mlp_layernorm.weight", ("model.layers.{layer}.post_attention_layernorm.weight",)),
]
_GATED_SHARED_MOE_MLP = [
    _ROUTER,
    Row(LAYER + "mlp.shared_experts.linear_fc1.weight",
        ("model.layers.{layer}.mlp.shared_expert.gate_proj.weight",
         "model.layers.{layer}.mlp.shared_expert.up_proj.weight"), "gate_up", layers="moe"),
    Row(LAYER + "mlp.shared_experts.linear_fc2.weight",
        ("model.layers.{layer}.mlp.shared_expert.down_proj.weight",), layers="moe"),
    Row(LAYER + "mlp.shared_experts.gate_weight", ("model.layers.{layer}.mlp.shared_expert_gate.weight",),
        layers="moe"),
    *_EXPERTS,
]

# Qwen3.5-MoE: Qwen3-Next's text model under model.language_model., its linear attention's input
# projections stored apart ([q|k|v], z, beta, alpha: Megatron's in_proj is their concatenation).
_QWEN35_IN_PROJ = Row(LAYER + "self_attention.in_proj.weight",
                      tuple(_LINEAR + f"in_proj_{p}.weight" for p in ("qkv", "z", "b", "a")), "qkv_z_b_a",
                      layers="linear")


def _text_model(rows: List[Row]) -> List[Row]:
    return [dataclasses.replace(row, hf=tuple("model.language_model." + h[len("model."):]
                                              if h.startswith("model.") else h for h in row.hf))
            for row in rows]


TABLES: Dict[str, List[Row]] = {
    "llama": [_EMBED, *_ATTENTION, *_DENSE_MLP, *_FINAL],
    "qwen2": [_EMBED, *_ATTENTION, *_DENSE_MLP, *_FINAL],
    "qwen3": [_EMBED, *_ATTENTION, *_DENSE_MLP, *_FINAL],
    "qwen3_moe": [_EMBED, *_ATTENTION, *_QWEN3_MOE_MLP, *_FINAL],
    "mixtral": [_EMBED, *_ATTENTION, *_MIXTRAL_MLP, *_FINAL],
    "glm4_moe": [_EMBED, *_ATTENTION, *_DENSE_MLP, *_DEEPSEEK_MOE_MLP, *_FINAL],
    "deepseek_v3": [_EMBED, *_MLA_ATTENTION, *_DENSE_MLP, *_DEEPSEEK_MOE_MLP, *_FINAL],
    "qwen3_next": [_EMBED, *_HYBRID_ATTENTION, *_GATED_SHARED_MOE_MLP, *_FINAL],
    "qwen3_5_moe": _text_model([_EMBED, *[_QWEN35_IN_PROJ if row.transform == "qkvzba" else row
                                          for row in _HYBRID_ATTENTION], *_GATED_SHARED_MOE_MLP, *_FINAL]),
    "gpt_oss": [_EMBED, *_GPT_OSS, *_FINAL],
}

# The critic's head has no counterpart in a causal-LM checkpoint; HF token-classification value
# models (TRL, OpenRLHF) call it `score`.
VALUE_HEAD = Row("output_layer.weight", ("score.weight",))


def _applies(row: Row, arch: ModelArch) -> bool:
    return {"always": True, "untied": not arch.tie_embeddings, "qkv_bias": arch.qkv_bias,
            "qk_norm": arch.qk_norm, "q_lora": arch.q_lora_rank > 0,
            "no_q_lora": arch.q_lora_rank == 0, "sinks": arch.attention_sinks}[row.when]


def _in_layer(row: Row, arch: ModelArch, layer: int) -> bool:
    if row.layers in ("linear", "full"):
        return (row.layers == "linear") == arch.is_linear_layer(layer)
    return row.layers == "all" or (row.layers == "moe") == arch.is_moe_layer(layer)


def rows(arch: ModelArch, role: str = "policy") -> List[Row]:
    table = [row for row in TABLES[arch.family] if _applies(row, arch)]
    if role == "value":
        table = [row for row in table if row.megatron != "output_layer.weight"] + [VALUE_HEAD]
    return table


@dataclass(frozen=True)
class Entry:
    """One concrete Megatron tensor of the full model and the HF tensors it is made of."""
    megatron: str
    hf: Tuple[str, ...]
    transform: str


def _entry(row: Row, layer=None, expert=None) -> Entry:
    return Entry(row.megatron.format(layer=layer, expert=expert),
                 tuple(h.format(layer=layer, expert=expert) for h in row.hf), row.transform)


def entries(arch: ModelArch, role: str = "policy") -> Iterator[Entry]:
    """Every Megatron tensor of the full model, layer by layer: the table's rows before the layers,
    then each layer's own rows and each of its experts' rows together, then the rows after. A
    consumer that frees a module's inputs only once the module is complete (vLLM's layerwise
    reload) so holds at most one layer, never one kind of tensor of every layer."""
    table = rows(arch, role)
    per_layer = [i for i, row in enumerate(table) if "{layer}" in row.megatron]
    if not per_layer:
        yield from (_entry(row) for row in table)
        return
    yield from (_entry(row) for row in table[:per_layer[0]])
    layer_rows = [table[i] for i in per_layer if "{expert}" not in table[i].megatron]
    expert_rows = [table[i] for i in per_layer if "{expert}" in table[i].megatron]
    for layer in range(arch.num_layers):
        yield from (_entry(row, layer) for row in layer_rows if _in_layer(row, arch, layer))
        for expert in range(arch.num_experts if arch.is_moe_layer(layer) else 0):
            yield from (_entry(row, layer, expert) for row in expert_rows)
    yield from (_entry(row) for row in table[per_layer[-1] + 1:])


_NUMBERS = re.compile(r"^decoder\.layers\.(\d+)\.(?:mlp\.experts\.local_experts\.(\d+)\.)?")


def tied_output(arch: ModelArch, megatron_name: str, role: str) -> bool:
    """With tied embeddings and PP > 1 the last stage keeps its own copy of the embedding."""
    return role == "policy" and arch.tie_embeddings and megatron_name == "output_layer.weight"


def entry_of(arch: ModelArch, megatron_name: str, role: str) -> "Entry":
    """The Entry a rank's parameter of that canonical name loads from and exports to: a tied
    output layer's copy is the embedding's entry."""
    name = "embedding.word_embeddings.weight" if tied_output(arch, megatron_name, role) else megatron_name
    return entry_for(arch, name, role)


def entry_for(arch: ModelArch, megatron_name: str, role: str = "policy") -> Entry:
    """The Entry of one canonical Megatron name, or KeyError naming it."""
    match = _NUMBERS.match(megatron_name)
    layer, expert = (match.group(1), match.group(2)) if match else (None, None)
    template = megatron_name
    if layer is not None:
        template = LAYER.format(layer="{layer}") + megatron_name[len(f"decoder.layers.{layer}."):]
    if expert is not None:
        template = EXPERT.format(layer="{layer}", expert="{expert}") + megatron_name[match.end():]
    for row in rows(arch, role):
        if row.megatron == template and (layer is None or _in_layer(row, arch, int(layer))):
            return Entry(megatron_name,
                         tuple(h.format(layer=layer, expert=expert) for h in row.hf),
                         row.transform)
    raise KeyError(f"no {arch.family} weight-table row for Megatron tensor {megatron_name!r}")


def to_megatron(arch: ModelArch, entry: Entry, hf: List[torch.Tensor], tp: int) -> torch.Tensor:
    """HF tensors of one entry -> the full Megatron tensor (vocabulary padded for `tp`)."""
    if entry.transform == "qkv":
        return wt.merge_qkv(*hf, arch.num_heads, arch.num_kv_heads, arch.head_dim)
    if entry.transform == "gated_qkv":
        return wt.merge_gated_qkv(*hf, arch.num_heads, arch.num_kv_heads, arch.head_dim)
    if entry.transform == "qkvzba":
        return wt.merge_qkvzba(*hf, arch.linear_key_heads, arch.linear_value_heads,
                               arch.linear_key_dim, arch.linear_value_dim)
    if entry.transform == "qkv_z_b_a":
        return torch.cat(hf, dim=0)
    if entry.transform == "gate_up":
        return wt.merge_gate_up(*hf)
    if entry.transform == "vocab":
        return wt.pad_vocab(hf[0], padded_vocab_size(arch.vocab_size, tp))
    if entry.transform == "gate_up_interleaved":
        return wt.merge_interleaved_gate_up(hf[0])
    if entry.transform == "transpose":
        return wt.transpose(hf[0])
    return hf[0]


def to_hf(arch: ModelArch, entry: Entry, tensor: torch.Tensor) -> Dict[str, torch.Tensor]:
    """Full Megatron tensor of one entry -> its HF tensors by name."""
    if entry.transform == "qkv":
        parts = wt.split_qkv(tensor, arch.num_heads, arch.num_kv_heads, arch.head_dim)
    elif entry.transform == "gated_qkv":
        parts = wt.split_gated_qkv(tensor, arch.num_heads, arch.num_kv_heads, arch.head_dim)
    elif entry.transform == "qkvzba":
        parts = wt.split_qkvzba(tensor, arch.linear_key_heads, arch.linear_value_heads,
                                arch.linear_key_dim, arch.linear_value_dim)
    elif entry.transform == "qkv_z_b_a":
        parts = [t.contiguous() for t in tensor.split(qkv_z_b_a_sizes(arch), dim=0)]
    elif entry.transform == "gate_up":
        parts = wt.split_gate_up(tensor)
    elif entry.transform == "vocab":
        parts = [wt.unpad_vocab(tensor, arch.vocab_size)]
    elif entry.transform == "gate_up_interleaved":
        parts = wt.split_interleaved_gate_up(tensor)
    elif entry.transform == "transpose":
        parts = [wt.transpose(tensor)]
    else:
        parts = [tensor]
    return dict(zip(entry.hf, parts))


def qkv_z_b_a_sizes(arch: ModelArch) -> List[int]:
    """Rows of Qwen3.5's in_proj_qkv, in_proj_z, in_proj_b, in_proj_a in Megatron's in_proj."""
    value = arch.linear_value_heads * arch.linear_value_dim
    return [2 * arch.linear_key_heads * arch.linear_key_dim + value, value, arch.linear_value_heads,
            arch.linear_value_heads]


def read_entry(arch: ModelArch, entry: Entry, read_hf: Callable[[str], torch.Tensor],
               tp: int) -> torch.Tensor:
    return to_megatron(arch, entry, [read_hf(name) for name in entry.hf], tp)
