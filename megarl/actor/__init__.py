"""The actor (policy log-probs and update) and what it shares with the critic: the batch type,
packing, the Megatron schedule runner and the optimizer state."""
