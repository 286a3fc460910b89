"""Which of a vLLM engine's tensors it holds in fp32 whatever the model's dtype, by the names the
destination layout gives them (destination.vllm_layout):
- the MoE routers' parameters (vLLM's GateLinear: the gate weight, and gpt-oss's router bias)
  when model.router_fp32 builds them so (rollout/vllm/fp32_router.py); GLM-4.5's gate always,
  as vLLM builds it in fp32 itself;
- the routing bias of DeepSeek-V3 and GLM-4.5 (e_score_correction_bias) and the Gated DeltaNet
  layers' A_log (Qwen3-Next, Qwen3.5), fp32 parameters in vLLM.
A sync writes the model's dtype into them (the transport casts) but opens them at 4 bytes an
element, so the planners count them so (DestTensor.engine_bytes). Checked against the engine's
own dtypes by scripts/verify_sync.py (engine_fp32_mismatches) wherever the suite runs it in bf16."""

import dataclasses
from typing import Dict, Tuple

from megarl.models.hf.config import ModelArch
from megarl.models.weights.destination import DestTensor, RolloutLayout, vllm_rank_tensors

# GateLinear's parameters in each family's names: Qwen3-MoE, DeepSeek-V3, GLM-4.5, Qwen3-Next and
# Qwen3.5 (mlp.gate), Mixtral (block_sparse_moe.gate), gpt-oss (mlp.router, with a bias). Not
# Qwen3-Next's shared_expert_gate, a plain linear layer in the model's dtype.
ROUTER_SUFFIXES = (".mlp.gate.weight", ".block_sparse_moe.gate.weight", ".mlp.router.weight",
                   ".mlp.router.bias")
ALWAYS_FP32_SUFFIXES = (".e_score_correction_bias", ".linear_attn.A_log")
FP32_GATE_FAMILIES = ("glm4_moe",)


def held_in_fp32(arch: ModelArch, name: str, router_fp32: bool) -> bool:
    """Pure: whether the engine holds destination tensor `name` in fp32."""
    if name.endswith(ALWAYS_FP32_SUFFIXES):
        return True
    return name.endswith(ROUTER_SUFFIXES) and (router_fp32 or arch.family in FP32_GATE_FAMILIES)


def mark(arch: ModelArch, tensors: Tuple[DestTensor, ...], router_fp32: bool) -> Tuple[DestTensor, ...]:
    """One rank's destination tensors, those the engine holds in fp32 marked `fp32`."""
    return tuple(dataclasses.replace(t, fp32=True) if held_in_fp32(arch, t.name, router_fp32) else t
                 for t in tensors)


def fp32_layout(arch: ModelArch, layout: Dict[int, Tuple[DestTensor, ...]], router_fp32: bool
                ) -> Dict[int, Tuple[DestTensor, ...]]:
    """Every rank's destination tensors, marked (`mark`)."""
    marked: Dict[int, Tuple[DestTensor, ...]] = {}  # by id: ranks at one engine position share a tuple
    return {rank: marked.setdefault(id(tensors), mark(arch, tensors, router_fp32))
            for rank, tensors in layout.items()}


def engine_rank_tensors(arch: ModelArch, rollout: RolloutLayout, router_fp32: bool) -> Tuple[DestTensor, ...]:
    """One engine rank's tensors, marked (an engine's ranks hold equal shares: check_rollout
    refuses uneven splits): what the memory plan and plan_sync count an engine rank's weights by."""
    return mark(arch, vllm_rank_tensors(arch, rollout, 0), router_fp32)
