"""Rewards: built-in rule rewards, users' reward functions (megarl's and verl's signatures), a
reward per data source, and scoring once per sample in a pool of worker processes with a
per-sample timeout."""
