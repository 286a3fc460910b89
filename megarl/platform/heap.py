"""The process's heap and Python's garbage collector."""

import gc


def freeze_heap() -> None:
    """Collect, then move every object alive out of the collector's reach (gc.freeze), as vLLM does
    once an engine has started (gc_utils.freeze_gc_heap): what a process has imported lives as long
    as the process, and each later full collection skips it (vLLM makes seven in an engine's life,
    ~0.3 s of a core each over the imports' objects). An engine's shutdown unfreezes (vLLM's
    EngineCore.shutdown). A process that exits without shutting its engine down exits frozen,
    which skips the interpreter's last collections over those objects (~3 s of a core in a fork of
    the test zygote: docs/testing.md) but leaves them unfreed: nanobind (Triton's bindings) then
    prints a leak report on stderr."""
    gc.collect()
    gc.freeze()
