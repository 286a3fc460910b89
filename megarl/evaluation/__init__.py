"""Held-out evaluation: validation sets scored with the run's rollout engine and reward functions,
reported as reward, accuracy and pass@k per set and data source."""
