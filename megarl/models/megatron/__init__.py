"""Megatron-Core models: ModelArch -> TransformerConfig and layer spec, the policy and value models
(builder), megarl's portable layers, the expert-bias update and the parameter layout."""
