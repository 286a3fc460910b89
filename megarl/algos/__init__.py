"""RL algorithms as pure functions of tensors: advantages, policy and value losses, KL, entropy,
loss aggregation, and the vocabulary-parallel log-softmax. No configs, no state, no logging.

Shape glossary for this package (T differs from the model code's packed tokens):
  B batch (sequences), T tokens per sequence (padded response length), G group size (samples
  per prompt), N tokens flattened over any leading dims, V vocabulary, V/tp one TP shard.
Masks are float or bool [B, T] with 1 on real response tokens.

Each module keeps a name -> function registry; `pick` is the one lookup, done once at the edge.
"""

from typing import Callable, Dict


def pick(registry: Dict[str, Callable], name: str, what: str) -> Callable:
    """registry[name], or a ValueError naming the bad value and the allowed ones."""
    if name not in registry:
        raise ValueError(f"unknown {what} {name!r}; choose one of {sorted(registry)}")
    return registry[name]
