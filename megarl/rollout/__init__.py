"""Rollout: the RolloutEngine protocol and its vLLM implementation (colocated, external launcher)."""
