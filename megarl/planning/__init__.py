"""Run planning: what a run is before it starts. The typed configuration (YAML + dotted overrides),
the preflight that refuses a run that cannot work and resolves the one it will be, the memory plan
and the FLOPs count. Below the trainer and the rollout ranks, which both import it; it starts
nothing and holds no process group."""
