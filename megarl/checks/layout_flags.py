"""The layout the check scripts (scripts/verify_conversion.py, scripts/verify_sync.py) run at: their
layout flags, named as the run's layout section names its keys, and the ParallelDims they give.

A pipeline over a layer count with no even split takes the converter's uneven stages
(ParallelDims.fit_stages, the one choice both make) unless the first or last stage's size is
given, as a run gives it (layout.first_stage_layers, layout.last_stage_layers). Does not own the
arithmetic or its validation (parallel_state/dims.py).
"""

import argparse

from megarl.parallel_state.dims import ParallelDims


def add_layout_flags(parser: argparse.ArgumentParser, context_parallel: bool) -> None:
    """--tp --pp --ep [--cp] --etp --vpp --first-stage-layers --last-stage-layers."""
    for name in ("tp", "pp", "ep") + (("cp",) if context_parallel else ()):
        parser.add_argument(f"--{name}", type=int, default=1)
    parser.add_argument("--etp", type=int, default=None)
    parser.add_argument("--vpp", type=int, default=None)
    for end in ("first", "last"):
        parser.add_argument(f"--{end}-stage-layers", type=int, default=None, metavar="N",
                            help=f"layers of the {end} pipeline stage (a run's layout.{end}_stage_layers);\n"
                                 "default: the converter's split where --pp does not divide the layers")


def layout(args: argparse.Namespace, world_size: int, num_layers: int) -> ParallelDims:
    """The flags' layout on `world_size` ranks for a model of `num_layers` layers (ValueError naming
    the values that do not fit)."""
    dims = ParallelDims(world_size=world_size, tp=args.tp, pp=args.pp, ep=args.ep, cp=getattr(args, "cp", 1),
                        etp=args.etp, vpp=args.vpp, first_stage_layers=args.first_stage_layers,
                        last_stage_layers=args.last_stage_layers)
    return dims.fit_stages(num_layers)
