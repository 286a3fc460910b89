"""Transformer layer spec: Transformer Engine's on the GPU path, else megarl's portable one.

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
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import (
    TransformerBlockSubmodules,
    get_num_layers_to_build,
)
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

from megarl.models.portable_layers import PortableCoreAttention, RMSNorm


def transformer_engine_available() -> bool:
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        return False
    return True


class PortableSpecProvider(LocalSpecProvider):
    """Megatron's local modules, with a sequence-parallel norm and a context-parallel attention."""

    def layer_norm(self, rms_norm: bool = False, for_qk: bool = False) -> type:
        if not rms_norm:
            raise ValueError("the portable spec implements RMSNorm only (all supported families)")
        return RMSNorm

    def core_attention(self) -> type:
        return PortableCoreAttention


def te_norm_keys(num_experts: int) -> dict:
    """Checkpoint names of the separate norms as Transformer Engine's layer spec stores them."""
    keys = {"input_layernorm.": "self_attention.linear_qkv.layer_norm_"}
    if not num_experts:  # TE's MoE layer has a pre_mlp_layernorm of its own
        keys["pre_mlp_layernorm."] = "mlp.linear_fc1.layer_norm_"
    return keys


def portable_layer_spec(num_experts: int, qk_layernorm: bool) -> ModuleSpec:
    backend = PortableSpecProvider()
    norm = backend.layer_norm(rms_norm=True)
    return ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=norm,
            self_attention=ModuleSpec(
                module=SelfAttention,
                params={"attn_mask_type": AttnMaskType.causal},
                submodules=SelfAttentionSubmodules(
                    linear_qkv=backend.column_parallel_linear(),
                    core_attention=backend.core_attention(),
                    linear_proj=backend.row_parallel_linear(),
                    q_layernorm=norm if qk_layernorm else IdentityOp,
                    k_layernorm=norm if qk_layernorm else IdentityOp,
                ),
            ),
            self_attn_bda=get_bias_dropout_add,
            pre_mlp_layernorm=norm,
            mlp=get_mlp_module_spec_for_backend(backend=backend, num_experts=num_experts or None),
            mlp_bda=get_bias_dropout_add,
            sharded_state_dict_keys_map=te_norm_keys(num_experts),
        ),
    )


def decoder_spec(config, num_experts: int, qk_layernorm: bool, use_te: bool,
                 vp_stage=None) -> TransformerBlockSubmodules:
    """The layers this pipeline stage builds, and the final norm (which Megatron would otherwise
    pick itself, refusing sequence parallelism without Apex)."""
    if use_te:
        from megatron.core.extensions.transformer_engine import TENorm

        layer = get_gpt_layer_with_transformer_engine_spec(
            num_experts=num_experts or None, moe_grouped_gemm=bool(num_experts),
            qk_layernorm=qk_layernorm,
        )
        norm = TENorm
    else:
        layer = portable_layer_spec(num_experts, qk_layernorm)
        norm = RMSNorm
    num_layers = get_num_layers_to_build(config, vp_stage=vp_stage)
    return TransformerBlockSubmodules(layer_specs=[layer] * num_layers, layer_norm=norm)
