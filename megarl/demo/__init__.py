"""What `make demo` and the tests build locally: tiny checkpoints of each family, the arithmetic
task and its tokenizer, and the SFT warm start. Not used by training runs."""
