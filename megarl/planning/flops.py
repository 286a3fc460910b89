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
- Backward costs 2 x forward (gradients with respect to inputs and to weights; Narayanan et al.
  2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM",
  appendix). Activation recomputation is not counted: these are model FLOPs, not hardware FLOPs.
- Generation costs one forward over each finished sequence (prefill of the prompt, then each new
  token attends to its prefix through the KV cache). The last sampled token, which is never fed
  back, and a prompt prefilled once for all its samples (prefix caching) are not subtracted.
"""

from dataclasses import dataclass
from typing import Dict, Iterable, Optional

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
    return hidden * (q_width + 2 * kv_width) + q_width * hidden  # q, k, v in; output out


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
               + 3 * hidden * arch.shared_expert_ffn)
    mlp = sum(moe_mlp if arch.is_moe_layer(layer) else dense_mlp for layer in range(arch.num_layers))
    return arch.num_layers * _attention_params(arch) + mlp + hidden * outputs[head]


def attention_flops(arch: ModelArch, seq_len_sum_sq: int) -> int:
    """Forward FLOPs of the causal attention scores and value sums over packed sequences whose
    squared lengths sum to `seq_len_sum_sq`: 2 FLOPs x heads x (query-key width + value width)
    per (query, key) pair, half of the pairs needed (MLA: q/k heads carry the RoPE dims too)."""
    qk_dim = arch.head_dim + (arch.qk_rope_dim if arch.mla else 0)
    v_dim = arch.v_head_dim if arch.mla else arch.head_dim
    return arch.num_layers * arch.num_heads * (qk_dim + v_dim) * seq_len_sum_sq


def forward_flops(arch: ModelArch, tokens: int, seq_len_sum_sq: int, head: str = "lm") -> int:
    return 2 * matmul_params(arch, head) * tokens + attention_flops(arch, seq_len_sum_sq)


@dataclass(frozen=True)
class Phase:
    """The model work of one phase of a step: `tokens` through the model (summed over passes),
    the sum of their sequences' squared lengths, which head, and whether a backward follows."""
    tokens: int
    seq_len_sum_sq: int
    head: str = "lm"
    backward: bool = False

    @classmethod
    def of(cls, lengths: Iterable[int], passes: int = 1, head: str = "lm",
           backward: bool = False) -> "Phase":
        lengths = [int(n) for n in lengths]
        return cls(passes * sum(lengths), passes * sum(n * n for n in lengths), head, backward)


def step_flops(arch: ModelArch, phases: Dict[str, Phase]) -> Dict[str, int]:
    """Model FLOPs of each phase; their sum is the step's."""
    return {name: (3 if p.backward else 1) * forward_flops(arch, p.tokens, p.seq_len_sum_sq, p.head)
            for name, p in phases.items()}


def rl_phases(generated_lengths: Iterable[int], trained_lengths: Iterable[int], *, reference: bool,
              critic: bool, actor_epochs: int, critic_epochs: int) -> Dict[str, Phase]:
    """The loop's model phases, named as its timers. `generated_lengths`: prompt + response
    tokens of every sequence vLLM produced (also those dynamic sampling dropped);
    `trained_lengths`: those of the batch the models then see."""
    generated, trained = list(generated_lengths), list(trained_lengths)
    phases = {"generate": Phase.of(generated), "old_logprobs": Phase.of(trained)}
    if reference:
        phases["ref_logprobs"] = Phase.of(trained)
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

