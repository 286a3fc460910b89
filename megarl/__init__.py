"""megarl: a Megatron-Core native RL trainer (PPO, GRPO and relatives) for dense and MoE LLMs.

Glossary for shape comments used throughout the package:
  B batch, S sequence, T packed tokens, H hidden, V vocabulary (V/tp: one TP shard),
  E experts, F ffn hidden, D head dim, Nq query heads, Nkv key/value heads (query groups).
"""

__version__ = "0.1.0"
