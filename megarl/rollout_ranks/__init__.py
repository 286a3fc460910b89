"""The rollout ranks' program (layout.rollout_world_size > 0): each rank's launcher supervises an
engine process (supervisor.py) that serves rollouts (server.py), drawing each step's prompts and
rounds (step_draws.py, dynamic_sampling.py), scoring held-out sets (evaluation.py), and talking to
the trainers over a store (channel.py). The trainer side of it is trainer/disaggregated_rollouts.py."""
