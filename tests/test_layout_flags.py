"""The check scripts' layout (megarl/checks/layout_flags.py): a layer count --pp does not divide is
split as the converter splits it, the first and last stage fewer; the run's first/last stage sizes,
given as flags, are taken as given."""

import argparse

import pytest

from megarl.checks.layout_flags import add_layout_flags, layout
from megarl.parallel_state.dims import ParallelDims


def _layout(flags, world, layers):
    parser = argparse.ArgumentParser()
    add_layout_flags(parser, context_parallel=True)
    return layout(parser.parse_args(flags), world, layers)


@pytest.mark.parametrize("flags,world,layers,counts", [
    (["--pp", "2"], 2, 3, [1, 2]),  # the tiny DeepSeek-V3 / GLM-4.5 of three layers
    (["--tp", "2", "--pp", "2"], 4, 3, [1, 2]),
    (["--pp", "2", "--ep", "2", "--cp", "2"], 4, 5, [2, 3]),
    (["--pp", "4"], 4, 61, [14, 16, 16, 15]),  # DeepSeek-V3
    (["--pp", "8"], 8, 61, [6, 8, 8, 8, 8, 8, 8, 7]),
    (["--pp", "2"], 2, 4, [2, 2]),  # an even split stays even
    (["--pp", "2", "--last-stage-layers", "1"], 2, 3, [2, 1]),  # the run's sizes, as given
    (["--pp", "8", "--first-stage-layers", "5", "--last-stage-layers", "2"], 8, 61, [5] + [9] * 6 + [2]),
])
def test_stages(flags, world, layers, counts):
    assert _layout(flags, world, layers).stage_layers(layers) == counts


@pytest.mark.parametrize("world,layers", [(2, 3), (2, 61), (3, 4), (4, 6), (4, 5), (8, 61), (5, 61)])
def test_the_checks_split_as_the_converter_does(world, layers):
    """One choice (ParallelDims.fit_stages): a checkpoint the converter wrote on `world` ranks checks
    at PP `world` with the stages it had."""
    converted = ParallelDims.for_conversion(world, layers)
    checked = _layout(["--pp", str(world)], world, layers)
    assert checked == converted
    assert checked.stage_layers(layers) == converted.stage_layers(layers)


def test_what_has_no_split_is_refused_by_name():
    """Interleaved stages are even in megarl, and a stage needs a layer: left as given, the layout
    is refused naming the values."""
    with pytest.raises(ValueError, match=r"num_layers\(6\) must be divisible by pp\(2\) \* vpp\(2\) = 4"):
        _layout(["--pp", "2", "--vpp", "2"], 2, 6).stage_layers(6)
    with pytest.raises(ValueError, match=r"num_layers\(1\) must be divisible by pp\(2\)"):
        _layout(["--pp", "2"], 2, 1).stage_layers(1)
    with pytest.raises(ValueError, match=r"first_stage_layers=1 needs pipeline parallelism"):
        _layout(["--first-stage-layers", "1"], 1, 3)
