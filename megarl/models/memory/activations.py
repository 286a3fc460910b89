"""What a training forward keeps for its backward: bytes per token of each layer, per rank.

Owns the count of the tensors Megatron-Core's layers save (autograd's saved inputs), layer by
layer, under megarl's layout (sequence parallel whenever tp > 1, so norms and linear inputs are
saved sharded over TP; context parallel splits tokens over CP) and recompute settings. Pure
arithmetic on ModelArch; the memory planner (planning/memory_plan.py) multiplies it by a
micro-batch's tokens and the micro-batches a pipeline stage holds at once.

The count, per token of this rank, in elements of the model's dtype unless noted:
  norms            the input of each norm (h/tp each; recompute "layernorm": their outputs,
                   which the next linear saves, are recomputed instead: - h/tp each)
  attention        the QKV linear's input (h/tp), q and k before their norm (qk-norm models),
                   and what the attention kernel saves: q, k, v and its output, with k and v per
                   KV head (flash attention) or per query head (the portable attention repeats
                   them before its kernel); + a fp32 log-sum-exp per head
  MLA              the down projections' outputs and their norms' inputs, then q, k, v per head
                   (recompute "mla_up_proj": the up projections' outputs are recomputed)
  dense MLP        fc1's input (h/tp), its output (2 x ffn/tp: gate and up) and the activation's
                   output (ffn/tp) (recompute "mlp": only the input kept)
  MoE MLP          the router's input and its fp32 logits and probabilities (E each), each routed
                   copy of a token (top-k of them, spread over the EP ranks, on average top-k per
                   token of the EP group's ranks): the permuted input (h), fc1's output (2 x moe
                   ffn/etp) and the activation's output (moe ffn/etp; recompute "moe_act": dropped),
                   and the experts' output before the weighted unpermute (h); shared experts as a
                   dense MLP (recompute "shared_experts": dropped). Recompute "moe": only the input.
  full recompute   a recomputed unit keeps only its input (h/tp); the one unit being recomputed
                   in the backward holds its full count meanwhile.
  linear attention the Gated DeltaNet hybrids' (activations_hybrid.py)
Assumed: dropout 0 (megarl's configs), even expert load (top-k copies spread evenly over the EP
ranks: a skewed router holds more on its busiest rank).
"""

from typing import List, Tuple

from megarl.models.hf.config import ModelArch
from megarl.models.megatron.config import RecomputeConfig
from megarl.models.memory import activations_hybrid as hybrid
from megarl.parallel_state.dims import ParallelDims

FP32 = 4


def _attention(arch: ModelArch, tp: int, flash: bool, recompute: frozenset) -> float:
    h, a, g, hd = arch.hidden_size, arch.num_heads, arch.num_kv_heads, arch.head_dim
    if arch.mla:
        qk = arch.head_dim + arch.qk_rope_dim  # megarl's head_dim is MLA's no-RoPE part
        down = (arch.q_lora_rank or 0) + arch.kv_lora_rank + arch.qk_rope_dim
        up = 0 if "mla_up_proj" in recompute else a * (2 * qk + arch.v_head_dim) / tp
        return h / tp + 2 * down + up + a * arch.v_head_dim / tp
    kv_heads = g if flash else a
    saved = h / tp + (a + 2 * kv_heads) * hd / tp + a * hd / tp  # input, q, k, v, output
    if arch.qk_norm:
        saved += (a + g) * hd / tp
    return saved


def _dense_mlp(ffn: int, h: int, tp: int) -> float:
    return h / tp + 3 * ffn / tp


def _moe_mlp(arch: ModelArch, dims: ParallelDims, dtype_bytes: int, recompute: frozenset) -> float:
    h, tp, etp, k = arch.hidden_size, dims.tp, dims.expert_tp, arch.moe_topk
    # Each rank routes its h/tp-sharded tokens; after the dispatch an expert rank holds on average
    # k copies per token of its EP peers, gathered over its expert-TP group (x etp tokens, ffn/etp).
    routed = k / tp * etp
    ffn = arch.moe_ffn_hidden_size / etp
    per_copy = 2 * h + (2 * ffn if "moe_act" in recompute else 3 * ffn)
    router = h / tp + 2 * arch.num_experts * FP32 / dtype_bytes / tp
    shared = 0.0
    if arch.shared_expert_ffn and "shared_experts" not in recompute:
        shared = _dense_mlp(arch.shared_expert_ffn, h, tp)
    return router + routed * per_copy + shared


def layer_elements(arch: ModelArch, layer: int, dims: ParallelDims, dtype_bytes: int, flash: bool,
                   modules: frozenset = frozenset()) -> float:
    """Pure: elements of the model's dtype one token of this rank's micro-batch keeps in `layer`
    (global index) from its forward to its backward, with the selective recompute `modules`."""
    h, tp = arch.hidden_size, dims.tp
    norms = 2 * h / tp - (2 * h / tp if "layernorm" in modules else 0)
    lse = arch.num_heads / tp * FP32 / dtype_bytes
    attention = _attention(arch, tp, flash, modules) + lse + hybrid.output_gate(arch, tp)
    if arch.is_linear_layer(layer):  # Gated DeltaNet (activations_hybrid.py)
        attention = hybrid.linear_attention(arch, tp, dtype_bytes)
    if arch.is_moe_layer(layer):
        mlp = h / tp if "moe" in modules else _moe_mlp(arch, dims, dtype_bytes, modules)
    else:
        mlp = h / tp if "mlp" in modules else _dense_mlp(arch.ffn_hidden_size, h, tp)
    return norms + attention + mlp


def stage_bytes_per_token(arch: ModelArch, dims: ParallelDims, layers: List[int], dtype_bytes: int,
                          flash: bool, recompute: RecomputeConfig) -> Tuple[float, float]:
    """Pure: (kept, recomputing) bytes per token of a micro-batch over `layers` (the global
    indices of one model chunk's layers, in order): what its forward keeps for its backward,
    and, with full recompute, what the one unit being recomputed holds during its backward (once
    per rank, however many micro-batches are in flight)."""
    modules = frozenset(recompute.modules or ("core_attn",)) if recompute.granularity == "selective" \
        else frozenset()
    full = [layer_elements(arch, layer, dims, dtype_bytes, flash, modules) for layer in layers]
    if recompute.granularity != "full":
        return sum(full) * dtype_bytes, 0.0
    n, width = recompute.num_layers, arch.hidden_size / dims.tp
    if recompute.method == "uniform":  # each unit of n layers keeps its input only
        units = [sum(full[i:i + n]) for i in range(0, len(layers), n)]
        return len(units) * width * dtype_bytes, max(units) * dtype_bytes
    # block: the chunk's first n layers keep their inputs only, the others everything
    recomputed = min(n, len(layers))
    kept = recomputed * width + sum(full[recomputed:])
    return kept * dtype_bytes, max(full[:recomputed], default=0) * dtype_bytes
