"""Megatron-Core without Transformer Engine: the shims that let its MoE, MLA and optimizer code run
with megarl's portable layer spec, on the CPU or on CUDA with `model.transformer_engine` off.

Owns every no-TE workaround and nothing else (the CPU ones are cpu_compat's). Active only where
this process builds without TE (`install()` returns without touching anything where it builds
with TE): Megatron decides at import whether TE is there, by module, and a TE that imports but is
turned off must not be reached either.
"""

import importlib

from megarl.platform import device_choice

_INSTALLED = False


def needed() -> bool:
    return not device_choice.uses_transformer_engine()


def install() -> None:
    """Install the shims once per process; a no-op where this process uses Transformer Engine."""
    global _INSTALLED
    if _INSTALLED or not needed():
        return
    # The router's gating GEMM calls TE's te_general_gemm when the name is not None, and the name
    # is only defined when TE imported (moe_utils.py:1192): None is torch.mm / addmm in any case.
    importlib.import_module("megatron.core.transformer.moe.moe_utils").te_general_gemm = None
    # Without Transformer Engine, megatron.core.extensions.transformer_engine still imports and
    # hands out stand-in classes; MLA would then take them for TE's linears (and with TE off,
    # TE's own classes are no concern of the portable spec's).
    mla = importlib.import_module("megatron.core.transformer.multi_latent_attention")
    mla.HAVE_TE = False
    # ...and it knows the replicated linear the portable spec uses for MLA's down projections
    # (layer_spec.py) only when that import worked.
    mla.Linear = importlib.import_module("megatron.core.post_training.modelopt.layers").Linear
    # The optimizer offload rides on the precision-aware optimizer, whose config asks for
    # Transformer Engine's version (optimizer_config.py:383) and fails on None without TE: no TE
    # is no TE of the minimum version.
    importlib.import_module("megatron.core.optimizer.optimizer_config").is_te_min_version = (
        lambda version, check_equality=True: False)
    _INSTALLED = True
