"""megarl: a Megatron-Core native RL trainer (PPO, GRPO and relatives) for dense and MoE LLMs.

Glossary for shape comments used throughout the package:
  B batch, S sequence, T packed tokens, H hidden, V vocabulary (V/tp: one TP shard),
  E experts, F ffn hidden, D head dim, Nq query heads, Nkv key/value heads (query groups).
"""

import warnings

__version__ = "0.1.0"

# Megatron-Core warns at import time that the optional GPU kernels are absent; megarl picks its
# portable modules for exactly that case, so these lines are noise on every CPU run.
for _message in ("Apex is not installed", "Transformer Engine and Apex are not installed",
                 "Transformer Engine is not installed"):
    warnings.filterwarnings("ignore", message=f".*{_message}.*")
