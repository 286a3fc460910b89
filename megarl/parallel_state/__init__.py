"""Parallel layout (ParallelDims), the Megatron-Core process-group adapter, the roles of a
disaggregated job and the links between them. Platform shims are in megarl/platform."""

from megarl.parallel_state.dims import ParallelDims

__all__ = ["ParallelDims"]
