"""ParallelDims rejects impossible layouts with the numbers and the fix in the message."""

import json
import os

import pytest

from megarl.parallel_state.dims import ParallelDims


def test_derived_sizes():
    dims = ParallelDims(world_size=8, tp=2, pp=2, ep=2, etp=1)
    assert (dims.dp, dims.expert_tp, dims.expert_dp) == (2, 1, 2)


@pytest.mark.parametrize("kwargs,message", [
    (dict(world_size=6, tp=4), r"tp\(4\) \* pp\(1\) \* cp\(1\) \* dp\(\?\) must equal world size 6"),
    (dict(world_size=4, tp=2, ep=4), r"etp\(2\) \* ep\(4\) \* pp\(1\)"),
    (dict(world_size=2, tp=0), r"tp must be a positive integer, got 0"),
    (dict(world_size=2, vpp=2), r"vpp\(2\) needs pipeline parallelism"),
])
def test_bad_layouts(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ParallelDims(**kwargs)


@pytest.mark.parametrize("dims,model,message", [
    (dict(world_size=2, pp=2), dict(num_layers=3), r"num_layers\(3\) must be divisible by pp\(2\)"),
    (dict(world_size=2, tp=2), dict(num_kv_heads=1),
     r"num_key_value_heads\(1\) must be divisible by tp\(2\).*use tp <= 1"),
    (dict(world_size=2, ep=2), dict(num_experts=3, moe_ffn_hidden=8),
     r"num_experts\(3\) must be divisible by ep\(2\)"),
    (dict(world_size=2, ep=2), dict(), r"ep\(2\) > 1 needs an MoE model"),
])
def test_model_does_not_fit_layout(dims, model, message):
    shape = dict(num_layers=4, num_heads=4, num_kv_heads=2) | model
    with pytest.raises(ValueError, match=message):
        ParallelDims(**dims).check_model(**shape)


def test_sequence_must_split_over_cp_and_tp():
    with pytest.raises(ValueError, match=r"sequence length 30 must be divisible by 2 \* cp = 4"):
        ParallelDims(world_size=2, cp=2).check_sequence(30)
    ParallelDims(world_size=4, cp=2, tp=2).check_sequence(32)


@pytest.mark.parametrize("world,layers,counts", [
    (4, 8, [2, 2, 2, 2]), (2, 3, [1, 2]), (3, 4, [1, 2, 1]), (4, 6, [1, 2, 2, 1]), (4, 5, [1, 1, 1, 2]),
    (1, 61, [61]), (2, 61, [30, 31]), (61, 61, [1] * 61), (60, 61, [1] * 59 + [2]),
])
def test_conversion_gives_every_rank_a_stage(world, layers, counts):
    dims = ParallelDims.for_conversion(world, layers)
    assert (dims.pp, dims.dp, dims.stage_layers(layers)) == (world, 1, counts)


@pytest.mark.parametrize("world,layers,pp", [(8, 4, 4), (64, 32, 32), (64, 61, 32), (12, 5, 4), (3, 2, 1)])
def test_more_ranks_than_layers_convert_with_replicas(world, layers, pp):
    """A whole allocation for a smaller model: the most stages that divide the world and fit the
    layers, every stage holding layers, and the rest data-parallel replicas."""
    dims = ParallelDims.for_conversion(world, layers)
    assert (dims.pp, dims.dp) == (pp, world // pp)
    assert min(dims.stage_layers(layers)) >= 1 and sum(dims.stage_layers(layers)) == layers


@pytest.mark.parametrize("world", [2, 4, 8, 16])
def test_deepseek_v3_converts_on_every_rank(world):
    """The published DeepSeek-V3 config (61 layers) at conversion worlds 2-16: Megatron's own layer
    assignment (what build_model builds on each stage, from the TransformerConfig it validates)
    gives every stage layers, contiguous and covering all 61, none more than an even share."""
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    from megarl.models.hf.config import arch_from_hf_config
    from megarl.models.megatron.config import transformer_config

    with open(os.path.join(os.path.dirname(__file__), "..", "docs", "configs", "deepseek-v3.json")) as f:
        arch = arch_from_hf_config(json.load(f))
    dims = ParallelDims.for_conversion(world, arch.num_layers)
    config = transformer_config(arch, dims)
    counts = [get_num_layers_to_build(config, pp_rank=stage) for stage in range(world)]
    offsets = [get_transformer_layer_offset(config, pp_rank=stage) for stage in range(world)]
    assert dims.pp == world and min(counts) >= 1 and sum(counts) == 61
    assert offsets == [sum(counts[:stage]) for stage in range(world)]
    assert max(counts) == -(-61 // world)


@pytest.mark.parametrize("fields,layers,counts", [
    (dict(pp=2), 4, [2, 2]),
    (dict(pp=2, vpp=2), 8, [2, 2, 2, 2]),
    (dict(pp=2, first_stage_layers=1), 4, [1, 3]),
    (dict(pp=2, last_stage_layers=3), 4, [1, 3]),
    (dict(pp=8, first_stage_layers=5, last_stage_layers=2), 61, [5, 9, 9, 9, 9, 9, 9, 2]),  # DeepSeek-V3
    (dict(pp=4, first_stage_layers=1, last_stage_layers=1), 4, [1, 1, 1, 1]),
])
def test_layers_per_stage(fields, layers, counts):
    dims = ParallelDims(world_size=fields["pp"], **fields)
    assert dims.stage_layers(layers) == counts
    assert sum(counts) == layers


@pytest.mark.parametrize("fields,layers,message", [
    (dict(pp=8), 61, r"num_layers\(61\) must be divisible by pp\(8\).*first_stage_layers"),
    (dict(pp=8, first_stage_layers=4), 61, r"first_stage_layers=4 and last_stage_layers=None leave 57 "
                                           r"of num_layers\(61\) for 7 other pipeline stages"),
    (dict(pp=4, first_stage_layers=2, last_stage_layers=2), 4, r"leave 0 of num_layers\(4\) for 2"),
])
def test_uneven_stages_that_do_not_fit_are_refused(fields, layers, message):
    with pytest.raises(ValueError, match=message):
        ParallelDims(world_size=fields["pp"], **fields).stage_layers(layers)


@pytest.mark.parametrize("fields,message", [
    (dict(world_size=2, first_stage_layers=1), r"first_stage_layers=1 needs pipeline parallelism"),
    (dict(world_size=2, pp=2, vpp=2, last_stage_layers=1), r"without interleaving; set vpp=None"),
    (dict(world_size=2, pp=2, first_stage_layers=1, last_stage_layers=1), r"not both"),
    (dict(world_size=2, pp=2, first_stage_layers=0), r"first_stage_layers must be a positive"),
])
def test_bad_uneven_layouts(fields, message):
    with pytest.raises(ValueError, match=message):
        ParallelDims(**fields)
