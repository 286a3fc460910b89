"""Verification, not training: HF-parity checks of a Megatron layout and the end-to-end check of
a weight sync. Used by scripts/verify_*.py, the benchmarks and the tests; the trainer does not
import it."""
