"""Hugging Face checkpoints: config.json -> ModelArch (config.py, config_deepseek.py, fields.py),
reading safetensors shards (safetensors_reader.py), and loading HF weights into Megatron chunks
(weights_io.py)."""
