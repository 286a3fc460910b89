"""Models, by concern: Hugging Face checkpoints and ModelArch (hf/), the Megatron-Core models
(megatron/), weight-name tables, conversion and checkpoints (weights/), LoRA (lora/), and the memory
a model will hold (memory/)."""
