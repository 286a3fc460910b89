"""The trainer: the RL loop and everything around it: launching the ranks (torchrun or Ray), the
run's typed config, preflight checks, checkpoints and resume, metrics, FLOPs and plots. It
orchestrates the packages below it (actor, critic, rollout, resharding, algos) and computes
nothing of its own."""
