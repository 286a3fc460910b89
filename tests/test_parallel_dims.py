"""ParallelDims rejects impossible layouts with the numbers and the fix in the message."""

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


def test_conversion_layout_uses_pipeline_stages_that_divide_layers():
    assert ParallelDims.for_conversion(4, 6).pp == 2
    assert ParallelDims.for_conversion(3, 4).pp == 1
