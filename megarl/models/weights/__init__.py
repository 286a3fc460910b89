"""Weight names and layouts as data: the per-family HF <-> Megatron tables and their split/merge
transforms, conversion, Megatron's dist checkpoints, MTP weights, and the vLLM (destination)
layout the weight sync writes."""
