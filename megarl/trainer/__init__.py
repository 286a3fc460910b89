"""The trainer: the RL loop and what runs it. The loop (loop.py) and its two rollout sources
(colocated engines: rollout_source.py; rollout ranks of their own: disaggregated_rollouts.py),
checkpoints and resume, launching the ranks (torchrun or Ray), and observability (metrics, the
console, plots). It orchestrates the packages below it and computes nothing of its own; run
planning (the config, preflight, memory plan) is in megarl/planning, the rollout ranks' program in
megarl/rollout_ranks."""
