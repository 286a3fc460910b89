"""Rollout: the RolloutEngine protocol and the engine-neutral code around it (producers, prompts,
tools, agent turns, collection); the vLLM backend is rollout/vllm/."""
