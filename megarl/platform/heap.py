"""The process's heap and Python's garbage collector."""

import atexit
import gc

_unfreeze_at_exit = False


def freeze_heap() -> None:
    """Collect, then move every object alive out of the collector's reach (gc.freeze), as vLLM does
    once an engine has started (gc_utils.freeze_gc_heap): what a process has imported lives as long
    as the process, and each later full collection skips it (vLLM makes seven in an engine's life,
    ~0.3 s of a core each over the imports' objects). Undone at exit, before the interpreter's last
    collection: objects still frozen then are never freed, and nanobind's extensions report each as
    a leak on stderr."""
    global _unfreeze_at_exit
    gc.collect()
    gc.freeze()
    if not _unfreeze_at_exit:
        atexit.register(gc.unfreeze)
        _unfreeze_at_exit = True
