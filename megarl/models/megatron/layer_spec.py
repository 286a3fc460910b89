"""Transformer layer spec: Transformer Engine's where the run uses it
(device_choice.uses_transformer_engine), else megarl's portable one.

Both write the same checkpoint keys. TE fuses the attention's input norm into `linear_qkv`
(`self_attention.linear_qkv.layer_norm_weight`) and, in a dense layer, the MLP's norm into
`linear_fc1`; a MoE layer keeps its own `pre_mlp_layernorm`. The portable spec maps its separate
norms to those names in sharded_state_dict, as Megatron's own local spec does for dense layers
(tests/test_spec_keys.py). TE's modules also store fp8 metadata (`_extra_state`) that the
portable ones lack; the loader tolerates it absent or extra (checkpoint.drop_absent_extra_state),
so a checkpoint written from either spec loads into the other.
"""

from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.models.backends import LocalSpecProvider
from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_layer_with_transformer_engine_spec,
    get_mlp_module_spec_for_backend,
)
from megatron.core.post_training.modelopt.layers import Linear as ReplicatedLinear
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.mlp import MLPSubmodules
from megatron.core.transformer.multi_latent_attention import (
    MLASelfAttention,
    MLASelfAttentionSubmodules,
)
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import (
    TransformerBlockSubmodules,
    get_num_layers_to_build,
)
from megatron.core.transformer.transformer_layer import (
    TransformerLayer,
    TransformerLayerSubmodules,
    get_transformer_layer_offset,
)

from megarl.models.hf.config import ModelArch
from megarl.models.megatron.gated_delta_net import GatedDeltaNet, GatedDeltaNetSubmodules
from megarl.models.megatron.portable_layers import ExpertRowParallelLinear, PortableCoreAttention, RMSNorm
from megarl.models.megatron.sink_attention import SinkWindowCoreAttention


class PortableSpecProvider(LocalSpecProvider):
    """Megatron's local modules, with a sequence-parallel norm and a context-parallel attention."""

    def layer_norm(self, rms_norm: bool = False, for_qk: bool = False) -> type:
        if not rms_norm:
            raise ValueError("the portable spec implements RMSNorm only (all supported families)")
        return RMSNorm

    def core_attention(self) -> type:
        return PortableCoreAttention

    def grouped_mlp_modules(self, moe_use_grouped_gemm: bool, moe_use_legacy_grouped_gemm: bool):
        """Megatron's SequentialMLP, whose experts' fc2 may carry a bias (gpt-oss)."""
        module, submodules = super().grouped_mlp_modules(moe_use_grouped_gemm, moe_use_legacy_grouped_gemm)
        if submodules is not None:
            submodules = MLPSubmodules(linear_fc1=submodules.linear_fc1, linear_fc2=ExpertRowParallelLinear)
        return module, submodules


def te_norm_keys(moe_layer: bool, mla: bool) -> dict:
    """Checkpoint names of the separate norms as Transformer Engine's layer spec stores them:
    fused into the linear that follows them (MLA's input norm stays separate in TE's spec)."""
    if mla:
        keys = {"self_attention.q_layernorm.": "self_attention.linear_q_up_proj.layer_norm_",
                "self_attention.kv_layernorm.": "self_attention.linear_kv_up_proj.layer_norm_"}
    else:
        keys = {"input_layernorm.": "self_attention.linear_qkv.layer_norm_"}
    if not moe_layer:  # TE's MoE layer has a pre_mlp_layernorm of its own
        keys["pre_mlp_layernorm."] = "mlp.linear_fc1.layer_norm_"
    return keys


def _portable_attention(backend, norm, arch: ModelArch) -> ModuleSpec:
    if arch.mla:
        # DeepSeek's latent norms (q_a_layernorm, kv_a_layernorm) are always there. The down
        # projections are replicated over TP, as TE's spec has them ('duplicated'): Megatron's
        # column-parallel variant gathers the shared RoPE key without summing its gradient over
        # the TP ranks (measured: kv_a_proj_with_mqa's gradient off by 55% at TP2).
        return ModuleSpec(
            module=MLASelfAttention,
            params={"attn_mask_type": AttnMaskType.causal},
            submodules=MLASelfAttentionSubmodules(
                linear_q_proj=backend.column_parallel_linear(),
                linear_q_down_proj=ReplicatedLinear,
                linear_q_up_proj=backend.column_parallel_linear(),
                linear_kv_down_proj=ReplicatedLinear,
                linear_kv_up_proj=backend.column_parallel_linear(),
                core_attention=backend.core_attention(),
                linear_proj=backend.row_parallel_linear(),
                q_layernorm=norm,
                kv_layernorm=norm,
            ),
        )
    return ModuleSpec(
        module=SelfAttention,
        params={"attn_mask_type": AttnMaskType.causal},
        submodules=SelfAttentionSubmodules(
            linear_qkv=backend.column_parallel_linear(),
            core_attention=SinkWindowCoreAttention if arch.attention_sinks or arch.sliding_window
            else backend.core_attention(),
            linear_proj=backend.row_parallel_linear(),
            q_layernorm=norm if arch.qk_norm else IdentityOp,
            k_layernorm=norm if arch.qk_norm else IdentityOp,
        ),
    )


def _linear_attention(backend) -> ModuleSpec:
    """Gated DeltaNet (Qwen3-Next's linear_attention layers) in the self-attention slot, as
    Megatron-Core's hybrid spec places it."""
    return ModuleSpec(module=GatedDeltaNet, submodules=GatedDeltaNetSubmodules(
        in_proj=backend.column_parallel_linear(), out_proj=backend.row_parallel_linear()))


def portable_layer_spec(arch: ModelArch, moe_layer: bool, linear: bool = False) -> ModuleSpec:
    backend = PortableSpecProvider()
    norm = backend.layer_norm(rms_norm=True)
    keys = te_norm_keys(moe_layer, arch.mla)
    if linear:  # TE's spec fuses the input norm into in_proj there
        keys["input_layernorm."] = "self_attention.in_proj.layer_norm_"
    return ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=norm,
            self_attention=_linear_attention(backend) if linear else
            _portable_attention(backend, norm, arch),
            self_attn_bda=get_bias_dropout_add,
            pre_mlp_layernorm=norm,
            mlp=get_mlp_module_spec_for_backend(backend=backend,
                                                num_experts=arch.num_experts if moe_layer else None),
            mlp_bda=get_bias_dropout_add,
            sharded_state_dict_keys_map=keys,
        ),
    )


def _te_layer_spec(arch: ModelArch, moe_layer: bool) -> ModuleSpec:
    return get_gpt_layer_with_transformer_engine_spec(
        num_experts=arch.num_experts if moe_layer else None, moe_grouped_gemm=moe_layer,
        qk_layernorm=arch.qk_norm or arch.mla, multi_latent_attention=arch.mla,
    )


def decoder_spec(config, arch: ModelArch, use_te: bool, vp_stage=None) -> TransformerBlockSubmodules:
    """The layers this pipeline stage builds (dense or MoE each, by global layer id), and the
    final norm (which Megatron would otherwise pick itself, refusing sequence parallelism
    without Apex)."""
    if use_te:
        from megatron.core.extensions.transformer_engine import TENorm

        layer_spec, norm = _te_layer_spec, TENorm
    else:
        layer_spec, norm = portable_layer_spec, RMSNorm
    offset = get_transformer_layer_offset(config, vp_stage=vp_stage)
    num_layers = get_num_layers_to_build(config, vp_stage=vp_stage)
    kinds = [(arch.is_moe_layer(offset + i), arch.is_linear_layer(offset + i)) for i in range(num_layers)]
    # linear-attention layers: the portable spec only (config_qwen3_next refuses TE for them)
    specs = {kind: portable_layer_spec(arch, *kind) if kind[1] else layer_spec(arch, kind[0])
             for kind in set(kinds)}
    return TransformerBlockSubmodules(layer_specs=[specs[kind] for kind in kinds], layer_norm=norm)
