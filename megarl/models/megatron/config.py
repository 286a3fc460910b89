"""ModelArch + ParallelDims -> Megatron-Core TransformerConfig.

Owns the numeric choices that make a Megatron model compute what the HF model computes
(RMSNorm eps, SwiGLU, GQA groups, QK norm, router softmax order, padded vocabulary), and
activation recompute (RecomputeConfig), which changes memory and time, never the numbers.
"""

import dataclasses
from dataclasses import dataclass
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel.layers import _grad_accum_fusion_available
from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

from megarl.models.hf.config import ModelArch
from megarl.models.megatron.config_gpt_oss import gpt_oss_fields, position_embedding_type, yarn_attributes
from megarl.models.megatron.config_qwen3_next import hybrid_fields
from megarl.parallel_state.dims import ParallelDims
from megarl.platform import device_choice

# Megatron pads the vocabulary so that every TP shard has the same width; 128 keeps the padded
# width friendly to GPU matmul tiles.
VOCAB_DIVISOR = 128


def padded_vocab_size(vocab_size: int, tp: int) -> int:
    multiple = VOCAB_DIVISOR * tp
    return -(-vocab_size // multiple) * multiple


RECOMPUTE_GRANULARITIES = ("none", "selective", "full")
RECOMPUTE_METHODS = ("uniform", "block")
# Megatron-Core 0.16's recompute_modules (TransformerConfig.__post_init__'s allowed set).
RECOMPUTE_MODULES = ("core_attn", "moe_act", "layernorm", "mla_up_proj", "mlp", "moe", "shared_experts")
# Modules whose recompute needs Transformer Engine. moe_act: Megatron recomputes the activation only
# in TE's grouped-GEMM experts (moe_grouped_gemm). layernorm: tensor_parallel/random.py:636
# (`self.fp8 = fp8 is not None`) makes every CheckpointWithoutOutput that the layer builds with
# the default fp8=False reach for TE's FP8GlobalStateManager.
TE_RECOMPUTE_MODULES = ("moe_act", "layernorm")


@dataclass(frozen=True)
class RecomputeConfig:
    """Activation recompute (Megatron-Core's): keep fewer activations in the forward and compute
    them again in the backward. `actor.recompute` / `critic.recompute`.

    granularity: none | selective (the `modules` of every layer) | full (whole layers, chosen
    by `method` and `num_layers`). uniform: every stage's layers in units of num_layers, only
    each unit's input kept; block: the first num_layers layers of each stage, the rest keep
    everything."""
    granularity: str = "none"
    method: Optional[str] = None  # full only: uniform | block
    num_layers: Optional[int] = None  # full only: layers per unit (uniform) or per stage (block)
    modules: Optional[Tuple[str, ...]] = None  # selective only; None: Megatron's ("core_attn",)

    def __post_init__(self):
        key = "recompute"
        if self.granularity not in RECOMPUTE_GRANULARITIES:
            raise ValueError(f"{key}.granularity={self.granularity!r}; choose one of "
                             f"{list(RECOMPUTE_GRANULARITIES)}")
        if self.granularity == "full":
            if self.method not in RECOMPUTE_METHODS or self.num_layers is None or self.num_layers < 1:
                raise ValueError(f"{key}.granularity=full needs {key}.method (uniform | block, got "
                                 f"{self.method!r}) and {key}.num_layers >= 1 (got {self.num_layers!r})")
        elif self.method is not None or self.num_layers is not None:
            raise ValueError(f"{key}.method={self.method!r} and {key}.num_layers={self.num_layers!r} "
                             f"choose whole layers for granularity=full; with granularity="
                             f"{self.granularity!r} leave them null")
        if self.modules is not None:
            if self.granularity != "selective":
                raise ValueError(f"{key}.modules={list(self.modules)} applies to granularity="
                                 f"selective only (got {self.granularity!r}): set it or drop modules")
            unknown = sorted(set(self.modules) - set(RECOMPUTE_MODULES))
            if unknown or not self.modules:
                raise ValueError(f"{key}.modules={list(self.modules)}: choose one or more of "
                                 f"{list(RECOMPUTE_MODULES)}")


NO_RECOMPUTE = RecomputeConfig()


def recompute_fields(recompute: RecomputeConfig, arch: ModelArch, dims: ParallelDims,
                     use_te: bool) -> dict:
    """Pure: the TransformerConfig fields of `recompute`, refusing (naming the value and the fix)
    what this model, layout or backend cannot run: Megatron's own rules come after these."""
    if recompute.granularity == "none":
        return {}
    if recompute.granularity == "selective":
        modules = list(recompute.modules or ("core_attn",))
        needs_te = sorted(set(modules) & set(TE_RECOMPUTE_MODULES))
        if needs_te and not use_te:
            raise ValueError(f"recompute.modules {needs_te} need Transformer Engine (absent or off "
                             "here): recompute core_attn, mlp, moe or shared_experts instead")
        model_only = {"moe": arch.num_experts, "moe_act": arch.num_experts,
                      "shared_experts": arch.shared_expert_ffn, "mla_up_proj": arch.mla}
        absent = sorted(m for m in modules if m in model_only and not model_only[m])
        if absent:
            raise ValueError(f"recompute.modules {absent} name parts {arch.family} does not have: "
                             "drop them")
        return dict(recompute_granularity="selective", recompute_modules=modules)
    stages = dims.stage_layers(arch.num_layers)  # layers of each model chunk
    n = recompute.num_layers
    if recompute.method == "uniform" and any(layers % n for layers in stages):
        raise ValueError(f"recompute.method=uniform recomputes units of recompute.num_layers={n} "
                         f"layers, which must divide every pipeline stage's layers {sorted(set(stages))}: "
                         "choose a divisor, or method=block")
    if recompute.method == "block" and n > max(stages):
        raise ValueError(f"recompute.num_layers={n} exceeds the most layers a pipeline stage holds "
                         f"({max(stages)}): use {max(stages)} to recompute every layer")
    return dict(recompute_granularity="full", recompute_method=recompute.method,
                recompute_num_layers=n)


def gpu_switches(on_gpu: bool, use_te: bool, interleaved: bool, grad_accum_kernel: bool) -> dict:
    """Pure: the fused kernels and batched p2p, on the GPU path only. On the CPU path there are
    no kernels to fuse, and unbatched p2p keeps the two directions of a 2-stage pipeline apart
    (gloo matches messages per peer in order). Batched p2p cannot go with the overlapped p2p of
    an interleaved schedule (Megatron refuses both). Gradient-accumulation fusion needs apex's
    fused_weight_gradient_mlp_cuda for Megatron's own linears (the output layer, and every linear
    of the portable spec); TE's linears bring their own.
    Without Transformer Engine (`use_te` False, on a GPU too) only RoPE fusion goes: Megatron's
    RoPE kernel is TE's (rope_utils imports it from extensions.transformer_engine, and
    TransformerConfig refuses the switch without it; with TE installed but off the switch would
    run TE's kernel). MLA's fused RoPE is a Triton kernel Megatron calls experimental; it goes
    with TE's, so a run without TE computes RoPE as the CPU suite checks it. The others are
    Megatron's own: the bias-SwiGLU and bias-dropout-add fusions are torch.jit / torch.compile
    functions (fusions/fused_bias_swiglu.py, fused_bias_dropout.py), and the masked-softmax kernel
    is read by Megatron's DotProductAttention only, which neither spec builds. The TE-only MoE
    fusions (moe_permute_fusion, moe_router_fusion) stay at their default, off; the grouped GEMM
    is TE's (transformer_config: moe_grouped_gemm=use_te)."""
    return dict(
        bias_activation_fusion=on_gpu,
        masked_softmax_fusion=on_gpu,
        bias_dropout_fusion=on_gpu,
        apply_rope_fusion=on_gpu and use_te,
        gradient_accumulation_fusion=on_gpu and grad_accum_kernel,
        batch_p2p_comm=on_gpu and not interleaved,
    )


def check_te_dtype(dtype: torch.dtype, use_te: bool) -> None:
    """megarl packs sequences (thd). Transformer Engine's flash and cuDNN attention take only
    bf16/fp16 and its unfused attention refuses thd, so an fp32 model would fail inside TE on its
    first forward: refused before anything starts. (Conversion builds the model without running
    it, so it does not ask.)"""
    if use_te and dtype == torch.float32:
        raise ValueError("the model's dtype is float32 (its config.json torch_dtype), which Transformer "
                         "Engine's attention cannot run on packed sequences: use a bfloat16 "
                         "checkpoint (torch_dtype / dtype 'bfloat16' in config.json), or the portable "
                         "layers: model.transformer_engine=false on the GPU, or MEGARL_DEVICE=cpu")


def transformer_config(arch: ModelArch, dims: ParallelDims, *, dtype: torch.dtype = None,
                       aux_loss_coeff: float = None, use_te: bool = False,
                       recompute: RecomputeConfig = NO_RECOMPUTE,
                       **overrides) -> TransformerConfig:
    """Build the TransformerConfig; `overrides` are TransformerConfig fields set last."""
    dense_layers = not arch.num_experts or arch.first_dense_layers
    dims.check_model(num_layers=arch.num_layers, num_heads=arch.num_heads,
                     num_kv_heads=arch.num_kv_heads, num_experts=arch.num_experts,
                     ffn_hidden=arch.ffn_hidden_size if dense_layers else 0,
                     moe_ffn_hidden=arch.moe_ffn_hidden_size)
    if arch.shared_expert_ffn % dims.tp:
        raise ValueError(f"the shared experts' width n_shared_experts * moe_intermediate_size = "
                         f"{arch.shared_expert_ffn} must be divisible by tp({dims.tp})")
    if arch.linear_bias and arch.num_experts and dims.expert_tp != 1:
        raise ValueError(f"{arch.family}'s experts carry biases, which Megatron-Core shards only at "
                         f"expert tensor parallel 1 (etp={dims.expert_tp}): set etp=1 (experts whole on "
                         "each rank, spread by ep)")
    dtype = dtype or arch.torch_dtype
    on_gpu = device_choice.on_gpu()
    moe = {}
    if arch.num_experts:
        moe = dict(
            num_moe_experts=arch.num_experts,
            moe_router_topk=arch.moe_topk,
            moe_ffn_hidden_size=arch.moe_ffn_hidden_size,
            # HF without top-k renormalization = softmax over all experts, then top-k.
            moe_router_pre_softmax=not arch.moe_norm_topk,
            moe_router_load_balancing_type="aux_loss",
            moe_aux_loss_coeff=arch.router_aux_loss_coef if aux_loss_coeff is None
            else aux_loss_coeff,
            moe_grouped_gemm=use_te,
            # Router logits and top-k in fp32 (model.router_fp32 can turn it off), as the MoE RL
            # anchors run it: bf16 logits tie and flip experts between rollout and update.
            moe_router_dtype="fp32",
            **deepseek_routing(arch),
        )
    fields = dict(
        num_layers=arch.num_layers,
        hidden_size=arch.hidden_size,
        ffn_hidden_size=arch.ffn_hidden_size,
        num_attention_heads=arch.num_heads,
        num_query_groups=arch.num_kv_heads,
        kv_channels=arch.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=arch.norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=arch.qkv_bias,
        qk_layernorm=arch.qk_norm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        **dims.megatron_sizes(),
        **dims.uneven_sizes(),
        sequence_parallel=dims.tp > 1,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        use_cpu_initialization=not on_gpu,
        # apex's persistent LayerNorm only; these models use RMSNorm.
        persist_layer_norm=False,
        # RL batches change length every step: pipeline stages exchange shapes first.
        variable_seq_lengths=True,
        # Interleaving overlaps p2p with compute as Megatron-LM does.
        overlap_p2p_comm=dims.vpp is not None,
        **gpu_switches(on_gpu, use_te, dims.vpp is not None, _grad_accum_fusion_available),
        moe_token_dispatcher_type="alltoall",  # the only dispatcher that allows variable lengths
        cp_comm_type="p2p" if use_te and dims.cp > 1 else None,
        **moe,
        **recompute_fields(recompute, arch, dims, use_te),
    )
    fields.update(hybrid_fields(arch, dims, use_te))
    config_class = TransformerConfig
    if arch.mla:
        config_class = MLATransformerConfig
        fields.update(mla_fields(arch))
    fields.update(gpt_oss_fields(arch))
    fields.update(overrides)
    unknown = set(overrides) - {f.name for f in dataclasses.fields(config_class)}
    if unknown:
        raise ValueError(f"unknown {config_class.__name__} fields {sorted(unknown)}")
    config = config_class(**fields)
    if position_embedding_type(arch) == "yarn":
        for name, value in yarn_attributes(arch).items():
            setattr(config, name, value)
    return config


def deepseek_routing(arch: ModelArch) -> dict:
    """Pure: DeepSeek-style routing (sigmoid + expert bias, groups, scaling, shared experts,
    dense first layers); nothing for softmax-routed families."""
    if arch.moe_score != "sigmoid":
        return {}
    return dict(
        moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=arch.moe_expert_bias,
        moe_router_num_groups=arch.moe_groups or None,
        moe_router_group_topk=arch.moe_group_topk or None,
        moe_router_topk_scaling_factor=arch.moe_scaling,
        moe_shared_expert_intermediate_size=arch.shared_expert_ffn or None,
        moe_layer_freq=[int(arch.is_moe_layer(layer)) for layer in range(arch.num_layers)],
    )


def mla_fields(arch: ModelArch) -> dict:
    """Pure: multi-latent attention's shapes and RoPE (YaRN when the checkpoint scales it)."""
    yarn = arch.yarn_factor != 1.0
    return dict(
        q_lora_rank=arch.q_lora_rank or None,
        kv_lora_rank=arch.kv_lora_rank,
        qk_head_dim=arch.head_dim,
        qk_pos_emb_head_dim=arch.qk_rope_dim,
        v_head_dim=arch.v_head_dim,
        rope_type="yarn" if yarn else "rope",
        rotary_base=arch.rope_theta,
        # Also the softmax scale's mscale: 1 leaves plain RoPE's 1/sqrt(d) alone.
        rotary_scaling_factor=arch.yarn_factor,
        original_max_position_embeddings=arch.yarn_original_max_positions or
        arch.max_position_embeddings,
        beta_fast=arch.yarn_beta_fast,
        beta_slow=arch.yarn_beta_slow,
        mscale=arch.yarn_mscale,
        mscale_all_dim=arch.yarn_mscale_all_dim,
    )
