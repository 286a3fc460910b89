"""Memory of a model before it exists: the parameters each rank holds (built on the meta device)
and the activations per token of each layer, for the memory plan (planning/memory_plan.py)."""
