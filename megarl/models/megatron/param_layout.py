"""Where each local parameter of a Megatron model sits in the full model.

Owns the metadata every weight movement needs: HF loading, HF export, gathering full gradients,
and resharding into vLLM. For each parameter of each model chunk on this rank: its
canonical full-model name (global layer and expert ids), and how the local tensor is cut from
the full one (TP dimension, SwiGLU halves). Pure given the model and the rank coordinates.
"""

import re
from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch
from megatron.core.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)

from megarl.parallel_state import megatron_groups

# Transformer Engine modules name a few tensors differently from the portable spec.
_TE_NAMES = (
    (re.compile(r"self_attention\.linear_qkv\.layer_norm_weight$"), "input_layernorm.weight"),
    (re.compile(r"mlp\.linear_fc1\.layer_norm_weight$"), "pre_mlp_layernorm.weight"),
    (re.compile(r"self_attention\.linear_q_up_proj\.layer_norm_weight$"),
     "self_attention.q_layernorm.weight"),
    (re.compile(r"self_attention\.linear_kv_up_proj\.layer_norm_weight$"),
     "self_attention.kv_layernorm.weight"),
    # TE's grouped experts: weight{i}, and bias{i} where experts carry biases (gpt-oss)
    (re.compile(r"mlp\.experts\.linear_fc(\d)\.(weight|bias)(\d+)$"),
     r"mlp.experts.local_experts.\3.linear_fc\1.\2"),
)

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
_LOCAL_EXPERT = re.compile(r"mlp\.experts\.local_experts\.(\d+)\.")


@dataclass(frozen=True)
class ParamSlot:
    canonical: str             # full-model name used by the weight tables
    tp_dim: Optional[int]      # dimension sharded over the (expert-)TP group; None: replicated
    tp_rank: int
    tp_size: int
    glu: bool                  # SwiGLU fc1: gate and up halves are sharded separately
    # Parts along dim 0 each sharded on its own, by their full sizes (Gated DeltaNet's in_proj
    # [q, k, v, z, beta, alpha] and conv1d [q, k, v]: the module sets param.tp_sections).
    sections: Tuple[int, ...] = ()


def _canonical(chunk_model, name: str, num_local_experts: int, ep_rank: int) -> str:
    for pattern, replacement in _TE_NAMES:
        name = pattern.sub(replacement, name)
    match = _LAYER.match(name)
    if match:
        layer = chunk_model.decoder.layers[int(match.group(1))]
        name = f"decoder.layers.{layer.layer_number - 1}." + name[match.end():]
    expert = _LOCAL_EXPERT.search(name)
    if expert:
        global_id = ep_rank * num_local_experts + int(expert.group(1))
        name = name[:expert.start()] + f"mlp.experts.local_experts.{global_id}." + name[expert.end():]
    return name


# Megatron's Transformer Engine wrappers, by class name (TE is not importable on the CPU path).
# Their `parallel_mode` cannot be trusted: an expert linear with EP or expert-TP > 1 does its own
# communication and sets TE's parallel_mode to None, while its weights stay sharded over the
# expert-TP group.
_TE_COLUMN = {"TEColumnParallelLinear", "TELayerNormColumnParallelLinear", "TEColumnParallelGroupedLinear"}
_TE_ROW = {"TERowParallelLinear", "TERowParallelGroupedLinear"}


def is_adapter(name: str) -> bool:
    """Whether a chunk's parameter (or state-dict) name is a LoRA adapter's (models/lora/adapters.py, the
    child `lora` of an adapted linear): not one of the model's weights, nor in its checkpoints."""
    return ".lora." in name


def canonical_name(chunk_model, name: str) -> str:
    """The canonical full-model name of a parameter (or module) name local to this rank's chunk."""
    num_local = (chunk_model.config.num_moe_experts or 0) // megatron_groups.expert().size
    return _canonical(chunk_model, name, num_local, megatron_groups.expert().rank)


def _parallel_mode(module: torch.nn.Module) -> Optional[str]:
    """'column' or 'row' for TP-sharded modules (Megatron's, or its TE wrappers), None for
    replicated ones. Read from the module type, not from parameter attributes, which Megatron sets
    only when it also initializes the weights."""
    if isinstance(module, (ColumnParallelLinear, VocabParallelEmbedding)):
        return "column"
    if isinstance(module, RowParallelLinear):
        return "row"
    classes = {cls.__name__ for cls in type(module).__mro__}
    if classes & _TE_COLUMN:
        return "column"
    if classes & _TE_ROW:
        return "row"
    return getattr(module, "parallel_mode", None)


def _tp_dim(module: torch.nn.Module, param_name: str) -> Optional[int]:
    if param_name == "softmax_offset":  # attention sinks: one per head, split with the heads
        return 0
    mode = _parallel_mode(module)
    if mode == "column" and (param_name.startswith("weight") or param_name == "bias"):
        return 0
    if mode == "row" and param_name.startswith("weight"):
        return 1
    return None


# Buffers that are part of the model's weights although no gradient trains them: the router's
# expert bias of aux-loss-free balancing (updated from token counts, and used by vLLM's routing).
WEIGHT_BUFFERS = re.compile(r"\.router\.expert_bias$")


def weight_slots(chunks: List[torch.nn.Module]) -> List[Tuple[ParamSlot, torch.Tensor]]:
    """Every tensor a checkpoint or the rollout engine holds: the parameters, then the weight
    buffers (WEIGHT_BUFFERS), each with its slot."""
    slots = param_slots(chunks)
    ep_rank = megatron_groups.expert().rank
    for chunk in chunks:
        num_local = (chunk.config.num_moe_experts or 0) // megatron_groups.expert().size
        for name, buffer in chunk.named_buffers():
            if WEIGHT_BUFFERS.search(name):
                slots.append((ParamSlot(canonical=_canonical(chunk, name, num_local, ep_rank),
                                        tp_dim=None, tp_rank=megatron_groups.tensor().rank,
                                        tp_size=megatron_groups.tensor().size, glu=False), buffer))
    return slots


def param_slots(chunks: List[torch.nn.Module]) -> List[Tuple[ParamSlot, torch.nn.Parameter]]:
    """Every parameter of this rank's chunks with its slot, in chunk and parameter order."""
    slots = []
    ep_rank = megatron_groups.expert().rank
    for chunk in chunks:
        config = chunk.config
        num_local = (config.num_moe_experts or 0) // megatron_groups.expert().size
        owners = {f"{prefix}.{pname}" if prefix else pname: (module, pname)
                  for prefix, module in chunk.named_modules()
                  for pname, _ in module.named_parameters(recurse=False)}
        for name, param in chunk.named_parameters():
            if is_adapter(name):
                continue
            if ".experts." in name:
                tp_rank, tp_size = (megatron_groups.expert_tensor().rank,
                                    megatron_groups.expert_tensor().size)
            else:
                tp_rank, tp_size = (megatron_groups.tensor().rank,
                                    megatron_groups.tensor().size)
            sections = tuple(getattr(param, "tp_sections", ()))
            tp_dim = (0 if sections else _tp_dim(*owners[name])) if tp_size > 1 else None
            canonical = _canonical(chunk, name, num_local, ep_rank)
            slots.append((ParamSlot(
                canonical=canonical,
                tp_dim=tp_dim,
                tp_rank=tp_rank, tp_size=tp_size,
                # by the canonical name: TE's grouped experts call theirs linear_fc1.weight{i}
                glu=config.gated_linear_unit and canonical.endswith("linear_fc1.weight"),
                sections=sections,
            ), param))
    return slots


def local_shard(full: torch.Tensor, slot: ParamSlot) -> torch.Tensor:
    """Cut this rank's piece out of the full tensor."""
    if slot.tp_dim is None:
        return full
    if slot.sections:
        return torch.cat([part.chunk(slot.tp_size, dim=0)[slot.tp_rank]
                          for part in full.split(slot.sections, dim=0)], dim=0)
    if slot.glu:
        return torch.cat([half.chunk(slot.tp_size, dim=0)[slot.tp_rank]
                          for half in full.chunk(2, dim=0)], dim=0)
    return full.chunk(slot.tp_size, dim=slot.tp_dim)[slot.tp_rank]


def join_shards(shards: List[torch.Tensor], tp_dim: Optional[int], glu: bool,
                sections: Tuple[int, ...] = ()) -> torch.Tensor:
    """Inverse of local_shard: shards of every TP rank, in rank order -> the full tensor."""
    if tp_dim is None:
        return shards[0]
    if sections:
        parts = [shard.split([size // len(shards) for size in sections]) for shard in shards]
        return torch.cat([torch.cat([p[i] for p in parts]) for i in range(len(sections))])
    if glu:
        halves = [shard.chunk(2, dim=0) for shard in shards]
        return torch.cat([torch.cat([h[0] for h in halves]), torch.cat([h[1] for h in halves])])
    return torch.cat(shards, dim=tp_dim)
