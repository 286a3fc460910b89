"""LoRA: adapters attached to Megatron's linears (adapters.py), PEFT folders in and out
(peft_io.py), and the dense delta scaling * B @ A of a PEFT tensor for engines that merge
(delta.py)."""
