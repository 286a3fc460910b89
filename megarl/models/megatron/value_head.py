"""The critic's scalar head: replaces GPTModel's vocabulary projection with H -> 1.

Owns only the head. The trunk is the policy's GPTModel, so actor and critic share every layer
implementation, layout and checkpoint key except this one.
"""

import torch
from megatron.core import tensor_parallel
from megatron.core.transformer.module import MegatronModule


class ValueHead(MegatronModule):
    """Called by GPTModel exactly like its output_layer: (hidden, weight=, runtime_gather_output=)
    -> (values [s, b, 1], None). The weight is replicated over TP; under sequence parallelism the
    hidden states are gathered first, so every TP rank computes (and differentiates) the same thing.
    The gather's backward therefore keeps this rank's slice of the (identical) gradient instead of
    summing TP copies of it, as the vocabulary projection's gather must.
    """

    def __init__(self, config):
        super().__init__(config=config)
        self.sequence_parallel = config.sequence_parallel
        self.weight = torch.nn.Parameter(
            torch.empty(1, config.hidden_size, dtype=config.params_dtype))
        config.init_method(self.weight)

    def forward(self, hidden_states, weight=None, runtime_gather_output=None):
        # hidden_states [s(/tp), b, H]
        if self.sequence_parallel:
            hidden_states = tensor_parallel.gather_from_sequence_parallel_region(
                hidden_states, tensor_parallel_output_grad=False)
        return torch.nn.functional.linear(hidden_states, self.weight), None  # [s, b, 1]
