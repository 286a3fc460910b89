"""The actor (policy log-probs and update) and what it shares with the critic: packing, the
Megatron schedule runner, the optimizer state and the generation memory handoff."""
