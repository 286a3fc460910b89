"""Parallel layout (ParallelDims), the Megatron-Core process-group adapter, and CPU shims."""

from megarl.parallel_state.dims import ParallelDims

__all__ = ["ParallelDims"]
