"""Sharding metadata of Transformer Engine modules, which cannot be built on the CPU path: Megatron's
TE wrappers are recognised by class name (stand-ins of the same names here), not by TE's
`parallel_mode`, which an expert linear sets to None once EP or expert-TP > 1 (Megatron then does
the communication; megatron/core/extensions/transformer_engine.py, TEGroupedLinear), while its
weights stay sharded over the expert-TP group; and TE's grouped experts' `weight{i}` names are
SwiGLU fc1 weights like the portable spec's."""

import pytest
import torch

from megarl.models.megatron.param_layout import _canonical, _tp_dim


def _te_class(name: str, base=torch.nn.Module):
    # What Megatron's TEGroupedLinear leaves behind with explicit expert communication.
    return type(name, (base,), {"parallel_mode": None})


TEGroupedLinear = _te_class("TEGroupedLinear")


@pytest.mark.parametrize("cls,param,dim", [
    (_te_class("TEColumnParallelGroupedLinear", TEGroupedLinear), "weight0", 0),
    (_te_class("TEColumnParallelGroupedLinear", TEGroupedLinear), "weight7", 0),
    (_te_class("TERowParallelGroupedLinear", TEGroupedLinear), "weight3", 1),
    (_te_class("TEColumnParallelLinear"), "weight", 0),  # a shared expert at ETP > 1
    (_te_class("TERowParallelLinear"), "weight", 1),
    (_te_class("TELayerNormColumnParallelLinear"), "layer_norm_weight", None),
    (_te_class("TENorm"), "weight", None),
])
def test_te_expert_linears_are_sharded_whatever_their_parallel_mode(cls, param, dim):
    assert cls().parallel_mode is None
    assert _tp_dim(cls(), param) == dim


def test_a_module_without_megatrons_classes_keeps_its_parallel_mode():
    column = type("SomeColumnLinear", (torch.nn.Module,), {"parallel_mode": "column"})
    assert _tp_dim(column(), "weight") == 0 and _tp_dim(column(), "bias") == 0


@pytest.mark.parametrize("name,canonical", [
    ("mlp.experts.linear_fc1.weight3", "mlp.experts.local_experts.7.linear_fc1.weight"),
    ("mlp.experts.linear_fc2.weight0", "mlp.experts.local_experts.4.linear_fc2.weight"),
    ("self_attention.linear_qkv.layer_norm_weight", "input_layernorm.weight"),
])
def test_te_names_become_the_portable_specs(name, canonical):
    # EP rank 1 of 2 with 4 local experts: local expert i is global expert 4 + i; the GLU rule
    # (param_slots) reads the canonical name, so weight{i} of fc1 is a SwiGLU fc1.
    assert _canonical(None, name, num_local_experts=4, ep_rank=1) == canonical
