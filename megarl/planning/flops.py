"""Model FLOPs of an RL step, FLOPs/s per device and MFU: the throughput numbers the loop logs
per step.

Owns the FLOPs formula and the table of device peaks. Pure functions of a ModelArch and token
counts (no Megatron, no process groups): the caller passes sequence lengths, seconds and the
world size in. Does not own timing (metrics.PhaseTimer), logging, or memory
(platform/device_memory.py).

The formula (model FLOPs, the numerator of MFU as PaLM defines it: Chowdhery et al. 2022,
"PaLM", Appendix B):
- A matmul costs 2 FLOPs per weight per token (a multiply and an add), so a forward costs
  2 x (weights one token meets) per token (Kaplan et al. 2020, "Scaling Laws for Neural
  Language Models", section 2.1). Those weights are the attention projections, the MLP (for MoE
  the router and the top-k routed experts only), and the output head. The embedding is a lookup;
  norms, RoPE, activations, softmax and biases are elementwise and left out, as in both papers.
- Attention scores (Q K^T) and their weighted sum of values cost 2 FLOPs x heads x head_dim
  each per (query, key) pair. With the causal mask half of the s x s pairs of a sequence are
  needed, so a forward costs 2 x layers x heads x head_dim x s^2 per sequence, summed over the
  packed sequences: this is Megatron-LM's count (training.py, num_floating_point_operations,
  "causal mask (only half of the mask is non-zero)"), so its logged TFLOP/s compare with ours.
  PaLM counts the full s x s matrix (12 L H Q T per token for training): twice this term.
- A sliding-window layer (gpt-oss) scores at most `window` keys a query (itself included): the
  (s - w)^2 / 2 pairs beyond the window are dropped, s^2/2 - (s - w)^2/2 a sequence, each packed
  sequence on its own. In the same continuous count as s^2/2 (which is s(s+1)/2 less s/2), this
  is the mask's pairs (sum over queries of min(position + 1, w)) less min(s, w)/2.
- A Gated DeltaNet layer (Qwen3-Next) has no score matrix: each value head carries a
  [key dim, value dim] state, and each token reads it with its key (S^T k), writes the delta rule's
  outer product into it (k delta^T) and reads it with its query (S^T q): 3 x 2 x key dim x value
  dim FLOPs a value head a token (the recurrent form's; chunked kernels do more work for the same
  result, as flash attention's recomputation is not counted either). Its projections and its
  depthwise causal convolution (2 FLOPs per weight per token, as a matmul) are weights.
- Backward costs 2 x forward (gradients with respect to inputs and to weights; Narayanan et al.
  2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM",
  appendix). Activation recomputation is not counted: these are model FLOPs, not hardware FLOPs.
- Generation costs one forward over each finished sequence (prefill of the prompt, then each new
  token attends to its prefix through the KV cache). The last sampled token, which is never fed
  back, and a prompt prefilled once for all its samples (prefix caching) are not subtracted.
"""

from dataclasses import dataclass
from typing import Dict, Iterable, Optional, Sequence, Tuple

import torch

from megarl.models.hf.config import ModelArch
from megarl.platform import device_choice

# Dense (no sparsity) bf16 tensor-core peak per device, from NVIDIA's datasheets, keyed by a
# substring of torch.cuda.get_device_name(); the longest matching key wins ("H100 PCIe" over "H100").
PEAK_FLOPS = {
    "H100": 989e12,  # SXM: "NVIDIA H100 80GB HBM3"
    "H100 PCIe": 756e12,
    "H100 NVL": 835e12,
    "H800": 989e12,
    "H800 PCIe": 756e12,
    "H200": 989e12,
    "H200 NVL": 835e12,
    "A100": 312e12,  # SXM4 and PCIe alike
}


def _attention_params(arch: ModelArch) -> int:
    hidden, heads = arch.hidden_size, arch.num_heads
    if arch.mla:  # low-rank q (or one q projection), the KV latent and its up-projection, output
        q_head = arch.head_dim + arch.qk_rope_dim
        q = (hidden * arch.q_lora_rank + arch.q_lora_rank * heads * q_head if arch.q_lora_rank
             else hidden * heads * q_head)
        kv = hidden * (arch.kv_lora_rank + arch.qk_rope_dim) + \
            arch.kv_lora_rank * heads * (arch.head_dim + arch.v_head_dim)
        return q + kv + heads * arch.v_head_dim * hidden
    q_width, kv_width = heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
    q_out = 2 * q_width if arch.attention_output_gate else q_width  # q_proj also makes the gate
    return hidden * (q_out + 2 * kv_width) + q_width * hidden  # q, k, v in; output out


def _linear_attention_params(arch: ModelArch) -> int:
    """A Gated DeltaNet layer's weights: q, k, v and the output gate z in one projection, the
    per-head beta and decay inputs, the depthwise convolution over q, k, v, the output."""
    keys = arch.linear_key_heads * arch.linear_key_dim
    values = arch.linear_value_heads * arch.linear_value_dim
    qkvz, ba = arch.hidden_size * (2 * keys + 2 * values), arch.hidden_size * 2 * arch.linear_value_heads
    return qkvz + ba + arch.linear_conv_kernel * (2 * keys + values) + values * arch.hidden_size


def matmul_params(arch: ModelArch, head: str = "lm") -> int:
    """Weights one token is multiplied by in a forward: the "active parameters" of the formula.
    A MoE layer counts its router, its top-k routed experts and its shared experts; the dense
    first layers of DeepSeek-style models their own MLP."""
    outputs = {"lm": arch.vocab_size, "value": 1}  # the policy's vocabulary; the critic's value
    if head not in outputs:
        raise ValueError(f"head={head!r}; choose one of {sorted(outputs)}")
    hidden = arch.hidden_size
    dense_mlp = 3 * hidden * arch.ffn_hidden_size  # SwiGLU: gate, up, down
    moe_mlp = (hidden * arch.num_experts + arch.moe_topk * 3 * hidden * arch.moe_ffn_hidden_size
               + 3 * hidden * arch.shared_expert_ffn + (hidden if arch.shared_expert_gate else 0))
    mlp = sum(moe_mlp if arch.is_moe_layer(layer) else dense_mlp for layer in range(arch.num_layers))
    mixers = sum(_linear_attention_params(arch) if arch.is_linear_layer(layer) else _attention_params(arch)
                 for layer in range(arch.num_layers))
    return mixers + mlp + hidden * outputs[head]


def scored_pairs_x2(lengths: Sequence[int], window: int = 0) -> int:
    """Twice the (query, key) pairs a causal attention layer scores over packed sequences of
    `lengths` (twice: an integer), each s^2/2 (Megatron's count); a `window` (keys a query
    sees, itself included; 0: none) drops the (s - w)^2/2 pairs beyond it."""
    return sum(n * n - (max(n - window, 0) ** 2 if window else 0) for n in lengths)


def attention_flops(arch: ModelArch, lengths: Sequence[int]) -> int:
    """Forward FLOPs of the token mixing no weight counts, over packed sequences of `lengths`:
    per causal attention layer 2 FLOPs x heads x (query-key width + value width) per scored
    (query, key) pair (MLA: q/k heads carry the RoPE dims too; a window layer scores fewer), per
    Gated DeltaNet layer its state's reads and write (the module docstring)."""
    qk_dim = arch.head_dim + (arch.qk_rope_dim if arch.mla else 0)
    v_dim = arch.v_head_dim if arch.mla else arch.head_dim
    per_pair = arch.num_heads * (qk_dim + v_dim)
    full, windowed = scored_pairs_x2(lengths), scored_pairs_x2(lengths, arch.sliding_window)
    delta_rule = 6 * arch.linear_value_heads * arch.linear_key_dim * arch.linear_value_dim * sum(lengths)
    total = 0
    for layer in range(arch.num_layers):
        if arch.is_linear_layer(layer):
            total += delta_rule
        else:
            sliding = arch.sliding_window and arch.window_layers and arch.window_layers[layer]
            total += per_pair * (windowed if sliding else full)
    return total


def forward_flops(arch: ModelArch, lengths: Sequence[int], head: str = "lm") -> int:
    """One forward over packed sequences of `lengths`."""
    return 2 * matmul_params(arch, head) * sum(lengths) + attention_flops(arch, lengths)


@dataclass(frozen=True)
class Phase:
    """The model work of one phase of a step: its sequences' `lengths`, how many times they pass
    through the model, which head, whether a backward follows, and the model when it is not the
    run's own (a distillation teacher's)."""
    lengths: Tuple[int, ...]
    passes: int = 1
    head: str = "lm"
    backward: bool = False
    arch: Optional[ModelArch] = None

    @classmethod
    def of(cls, lengths: Iterable[int], passes: int = 1, head: str = "lm",
           backward: bool = False, arch: Optional[ModelArch] = None) -> "Phase":
        return cls(tuple(int(n) for n in lengths), passes, head, backward, arch)


def step_flops(arch: ModelArch, phases: Dict[str, Phase]) -> Dict[str, int]:
    """Model FLOPs of each phase; their sum is the step's."""
    return {name: (3 if p.backward else 1) * p.passes * forward_flops(p.arch or arch, p.lengths, p.head)
            for name, p in phases.items()}


def rl_phases(generated_lengths: Iterable[int], trained_lengths: Iterable[int], *, reference: bool,
              critic: bool, actor_epochs: int, critic_epochs: int,
              teacher: Optional[ModelArch] = None) -> Dict[str, Phase]:
    """The loop's model phases, named as its timers. `generated_lengths`: prompt + response
    tokens of every sequence vLLM produced (also those dynamic sampling dropped);
    `trained_lengths`: those of the batch the models then see; `teacher`: a colocated
    distillation teacher's architecture (its forward over the batch runs on the trainer's ranks)."""
    generated, trained = list(generated_lengths), list(trained_lengths)
    phases = {"generate": Phase.of(generated), "old_logprobs": Phase.of(trained)}
    if reference:
        phases["ref_logprobs"] = Phase.of(trained)
    if teacher is not None:
        phases["teacher_logprobs"] = Phase.of(trained, arch=teacher)
    if critic:
        phases["values"] = Phase.of(trained, head="value")
    phases["actor_update"] = Phase.of(trained, actor_epochs, backward=True)
    if critic:
        phases["critic_update"] = Phase.of(trained, critic_epochs, head="value", backward=True)
    return phases


def mfu(flops_per_s_per_device: float, device_name: str) -> Optional[float]:
    """Model FLOPs utilization: achieved / peak; None where the peak is not known (CPU, new GPUs)."""
    matches = [key for key in PEAK_FLOPS if key in device_name]
    if not matches:
        return None
    return flops_per_s_per_device / PEAK_FLOPS[max(matches, key=len)]


def device_name() -> str:
    return torch.cuda.get_device_name() if device_choice.on_gpu() else "cpu"


def throughput_metrics(flops: Dict[str, int], seconds: Dict[str, float], world_size: int,
                       device: str) -> Dict[str, float]:
    """TFLOP/s per device over the whole step (`seconds` holds every phase's time, model phases
    or not) and per model phase, and the step's MFU where the device's peak is known."""
    per_device = sum(flops.values()) / sum(seconds.values()) / world_size
    metrics = {"throughput/tflops_per_device": per_device / 1e12}
    for phase, count in flops.items():
        if seconds.get(phase):
            metrics[f"throughput/tflops_per_device/{phase}"] = count / seconds[phase] / world_size / 1e12
    utilization = mfu(per_device, device)
    if utilization is not None:
        metrics["throughput/mfu"] = utilization
    return metrics

