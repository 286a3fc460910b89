"""Build the policy (GPTModel) and the value model (GPTModel trunk + ValueHead) on this rank.

Returns one module per virtual pipeline stage held by this rank (a list, as Megatron's schedules
expect). Parallel state must already be initialized (megarl.parallel_state.megatron_groups).
"""

import contextlib
from typing import List

import torch
from megatron.core import tensor_parallel
from megatron.core.models.gpt import GPTModel

from megarl.models.hf.config import ModelArch
from megarl.models.megatron.config import padded_vocab_size, transformer_config
from megarl.models.megatron.config_gpt_oss import position_embedding_type
from megarl.models.megatron.layer_spec import decoder_spec
from megarl.models.megatron.value_head import ValueHead
from megarl.parallel_state import megatron_groups
from megarl.parallel_state.dims import ParallelDims
from megarl.platform import device_choice

ROLES = ("policy", "value")


def build_model(arch: ModelArch, dims: ParallelDims, role: str = "policy", meta: bool = False,
                **config_overrides) -> List[GPTModel]:
    """`meta`: parameters on the meta device (shapes and attributes, no storage), for sizing a
    rank's model without its memory (models/memory/held_params.py). Built with Megatron's own layers
    (TE's layers hold the same parameters) and no initialization."""
    if role not in ROLES:
        raise ValueError(f"role {role!r} is not one of {ROLES}")
    use_te = device_choice.uses_transformer_engine() and not meta
    if meta:
        config_overrides.update(use_cpu_initialization=True, perform_initialization=False)
    config = transformer_config(arch, dims, use_te=use_te, **config_overrides)
    with _sized_only() if meta else contextlib.nullcontext():
        return [_chunk(arch, dims, role, config, use_te, vp_stage, on_device=not meta)
                for vp_stage in range(dims.virtual_stages)]


@contextlib.contextmanager
def _sized_only():
    """A build for its parameters' shapes: on the meta device, and without YaRN's cos/sin table,
    which Megatron's YarnRotaryEmbedding computes on the CPU at construction whatever the device
    (each MLA layer its own: 28 of the 41 s of building DeepSeek-V3's 16 stages, measured with
    cProfile on `pytest tests/test_presets.py -k 'passes_preflight and deepseek_v3'`). The table
    is a non-persistent buffer, rebuilt on a forward that finds none; a meta model runs none."""
    from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import YarnRotaryEmbedding

    build_table = YarnRotaryEmbedding._set_cos_sin_cache

    def no_table(self, seq_len, offset, dtype, packed_seq=False):
        self.max_seq_len_cached = -1  # any forward's length is beyond it: the table is built then

    YarnRotaryEmbedding._set_cos_sin_cache = no_table
    try:
        with torch.device("meta"):
            yield
    finally:
        YarnRotaryEmbedding._set_cos_sin_cache = build_table


def _chunk(arch: ModelArch, dims: ParallelDims, role: str, config, use_te: bool, vp_stage: int,
           on_device: bool) -> GPTModel:
    vp = vp_stage if dims.vpp else None
    model = GPTModel(
        config=config,
        transformer_layer_spec=decoder_spec(config, arch, use_te, vp_stage=vp),
        vocab_size=padded_vocab_size(arch.vocab_size, dims.tp),
        max_sequence_length=arch.max_position_embeddings,
        pre_process=megatron_groups.is_first_stage(vp),
        post_process=megatron_groups.is_last_stage(vp),
        share_embeddings_and_output_weights=arch.tie_embeddings and role == "policy",
        position_embedding_type=position_embedding_type(arch),
        rotary_percent=arch.rotary_percent,
        rotary_base=int(arch.rope_theta) if float(arch.rope_theta).is_integer() else arch.rope_theta,
        vp_stage=vp,
    )
    if role == "value" and model.post_process:
        model.output_layer = ValueHead(config)
    if on_device and device_choice.on_gpu():
        model.cuda()
    if not config.perform_initialization:
        mark_tensor_parallel_params(model)
    mark_expert_params(model)
    return model


def mark_expert_params(model: torch.nn.Module) -> None:
    """Routed experts' parameters belong to the expert-data-parallel group whatever the layout.
    Megatron-Core 0.16 marks them so (allreduce=False) only when ep > 1; at ep=1 with etp < tp
    their gradients were then reduced over the data-parallel group alone, not over the TP ranks
    that each ran the same experts on their own share of the tokens (Qwen3-MoE's expert gradients
    off by 100% at tp=2, etp=1: scripts/verify_conversion.py --grads), and gradient clipping
    counted each replica again. At ep=1 and etp=tp the two groups are the same ranks."""
    for name, param in model.named_parameters():
        if ".mlp.experts." in name:
            param.allreduce = False


# Split dimension of each Megatron-Core parallel layer's weight and bias (None: replicated bias).
_SPLIT_DIMS = {
    tensor_parallel.VocabParallelEmbedding: (0, None),
    tensor_parallel.ColumnParallelLinear: (0, 0),
    tensor_parallel.RowParallelLinear: (1, None),
}


def mark_tensor_parallel_params(model: torch.nn.Module) -> None:
    """Megatron sets a parameter's tensor-parallel attributes only while initializing it; without
    initialization (weights about to be loaded) gradient-norm clipping would count every TP shard
    as a duplicate of rank 0's. Set them from the layer types instead."""
    for module in model.modules():
        dims = next((d for kind, d in _SPLIT_DIMS.items() if isinstance(module, kind)), None)
        if dims is None:
            continue
        for name, dim in zip(("weight", "bias"), dims):
            param = getattr(module, name, None)
            if (isinstance(param, torch.nn.Parameter) and dim is not None
                    and not hasattr(param, "tensor_model_parallel")):
                tensor_parallel.set_tensor_model_parallel_attributes(param, True, dim, 1)
