"""Models: HF config -> ModelArch -> Megatron TransformerConfig and layer spec, the policy and
value models, weight-name tables and transforms, HF and Megatron checkpoint I/O and conversion."""
