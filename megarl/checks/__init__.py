"""Verification, not training: HF-parity checks of a Megatron layout, the end-to-end check of a
weight sync, and the layout the check scripts run at. Used by scripts/verify_*.py, the benchmarks
and the tests; the trainer does not import it."""
