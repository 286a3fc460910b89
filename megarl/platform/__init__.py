"""The machine megarl runs on: which device and layer spec it takes (device_choice: GPU or CPU,
Transformer Engine or Megatron's portable spec, never a silent fallback), its memory readings, the
install check, and the shims that let Megatron-Core run where it was not written to (cpu_compat
for gloo on a CPU, no_te_compat for CUDA without Transformer Engine). Each shim is on only where
its platform needs it."""
