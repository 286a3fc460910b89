"""MoE router logits and top-k in fp32 inside vLLM, as the trainer computes them
(model.router_fp32, Megatron's moe_router_dtype): in bf16, logits tie and flip experts between
the engine that samples and the trainer that scores.

vLLM 0.32 builds GLM-4.5's gate in fp32 already, DeepSeek-V3's fp32 output only when config.json
says `moe_router_dtype: float32`, and the other families' gates (Qwen3-MoE, Mixtral) in the
model's dtype. While an engine is built under `fp32_gates()`, every MoE gate (vLLM's GateLinear)
is made with fp32 weights and fp32 logits, so its matmul runs in fp32 (GateLinear casts the
hidden states to its weight's dtype) and the router's softmax/sigmoid and top-k see fp32.
Made at construction, not patched afterwards: CUDA graphs captured at start-up must see the
weights the syncs write (they write bf16 into the fp32 weights; megarl.resharding's transport
casts). Owns only that switch.
"""

import contextlib

import torch


@contextlib.contextmanager
def fp32_gates(enabled: bool = True):
    """Within: vLLM MoE gates built while the context is open have fp32 weights and output."""
    if not enabled:
        yield
        return
    from vllm.model_executor.layers.fused_moe.router.gate_linear import GateLinear

    build = GateLinear.__init__

    def build_in_fp32(self, *args, **kwargs):
        kwargs.update(params_dtype=torch.float32, out_dtype=torch.float32)
        build(self, *args, **kwargs)

    GateLinear.__init__ = build_in_fp32
    try:
        yield
    finally:
        GateLinear.__init__ = build
