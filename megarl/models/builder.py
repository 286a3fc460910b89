"""Build the policy (GPTModel) and the value model (GPTModel trunk + ValueHead) on this rank.

Returns one module per virtual pipeline stage held by this rank (a list, as Megatron's schedules
expect). Parallel state must already be initialized (megarl.parallel_state.megatron_groups).
"""

from typing import List

import torch
from megatron.core import parallel_state as mpu
from megatron.core.models.gpt import GPTModel

from megarl.models.hf_config import ModelArch
from megarl.models.layer_spec import decoder_spec, transformer_engine_available
from megarl.models.megatron_config import padded_vocab_size, transformer_config
from megarl.models.value_head import ValueHead
from megarl.parallel_state.dims import ParallelDims

ROLES = ("policy", "value")


def build_model(arch: ModelArch, dims: ParallelDims, role: str = "policy",
                **config_overrides) -> List[GPTModel]:
    if role not in ROLES:
        raise ValueError(f"role {role!r} is not one of {ROLES}")
    use_te = transformer_engine_available() and torch.cuda.is_available()
    config = transformer_config(arch, dims, use_te=use_te, **config_overrides)
    chunks = []
    for vp_stage in range(dims.virtual_stages):
        vp = vp_stage if dims.vpp else None
        model = GPTModel(
            config=config,
            transformer_layer_spec=decoder_spec(config, arch.num_experts, arch.qk_norm, use_te,
                                                vp_stage=vp),
            vocab_size=padded_vocab_size(arch.vocab_size, dims.tp),
            max_sequence_length=arch.max_position_embeddings,
            pre_process=mpu.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp),
            post_process=mpu.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp),
            share_embeddings_and_output_weights=arch.tie_embeddings and role == "policy",
            position_embedding_type="rope",
            rotary_base=int(arch.rope_theta) if float(arch.rope_theta).is_integer()
            else arch.rope_theta,
            vp_stage=vp,
        )
        if role == "value" and model.post_process:
            model.output_layer = ValueHead(config)
        if torch.cuda.is_available():
            model.cuda()
        chunks.append(model)
    return chunks
