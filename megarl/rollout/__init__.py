"""Rollout: the RolloutEngine protocol and the engine-neutral code around it (producers, prompts,
turns, collection); multi-turn tool-using rollouts are rollout/agent/, the vLLM backend rollout/vllm/."""
