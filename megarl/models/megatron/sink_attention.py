"""The portable core attention of gpt-oss: a learned sink logit per head in every softmax
(Megatron's softmax_type='learnable', `softmax_offset`) and sliding-window layers.

Owns the sink parameter (sharded over TP by heads, as Megatron's DotProductAttention shards it)
and the softmax with sinks, exact against transformers' eager gpt-oss attention. Packing,
context parallelism and GQA stay PortableCoreAttention's; the window applies per packed sequence
because the mask is built from each token's position in its own sequence.
"""

import torch
from megatron.core import tensor_parallel
from megatron.core.transformer.utils import is_layer_window_attention, make_sharded_tensors_for_checkpoint

from megarl.models.megatron.portable_layers import PortableCoreAttention
from megarl.parallel_state import megatron_groups


def sink_softmax_attention(q, k, v, allowed, sinks, scale: float, dropout: float = 0.0):
    """q [B, n, sq, d], k/v [B, n, sk, d], allowed [sq, sk] bool, sinks [n] -> [B, n, sq, dv]:
    softmax over [scores, sink] with the sink's share dropped (a head may attend to nothing).
    Through scaled_dot_product_attention, so memory stays that of its kernels (no [sq, sk] scores
    per head): one more key whose score is the sink (q gains a 1, the keys a 0, the sink key
    sink / scale in that dim) and whose value is zero."""
    b, n, sq, d = q.shape
    q = torch.cat([q, q.new_ones(b, n, sq, 1)], dim=-1)
    sink_key = torch.cat([k.new_zeros(b, n, 1, d),
                          (sinks.to(k.dtype) / scale).reshape(1, n, 1, 1).expand(b, n, 1, 1)], dim=-1)
    k = torch.cat([torch.cat([k, k.new_zeros(*k.shape[:-1], 1)], dim=-1), sink_key], dim=-2)
    v = torch.cat([v, v.new_zeros(b, n, 1, v.shape[-1])], dim=-2)
    allowed = torch.cat([allowed, allowed.new_ones(sq, 1)], dim=-1)
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=allowed,
                                                            dropout_p=dropout, scale=scale)


class SinkWindowCoreAttention(PortableCoreAttention):
    """PortableCoreAttention with sinks (config.softmax_type 'learnable') and, on the layers
    config.window_attn_skip_freq marks, the window config.window_size = (W - 1, 0)."""

    def __init__(self, config, layer_number, attn_mask_type, attention_type, **kwargs):
        super().__init__(config, layer_number, attn_mask_type, attention_type, **kwargs)
        if config.softmax_type not in ("vanilla", "learnable"):
            raise ValueError(f"softmax_type={config.softmax_type!r}: the portable attention has "
                             "'vanilla' and 'learnable' (sinks)")
        pg = kwargs.get("pg_collection")
        self.tp_group = pg.tp if pg is not None and hasattr(pg, "tp") else megatron_groups.tensor().group
        tp = self.tp_group.size() if self.tp_group is not None else 1
        self.window = None
        if is_layer_window_attention(config.window_size, config.window_attn_skip_freq, layer_number):
            left, right = config.window_size
            if right != 0 or left < 0:
                raise ValueError(f"window_size={config.window_size}: the portable attention is causal "
                                 "with a left window only, (W - 1, 0)")
            self.window = left
        self.softmax_offset = None
        if config.softmax_type == "learnable":
            self.softmax_offset = torch.nn.Parameter(torch.zeros(
                config.num_attention_heads // tp, dtype=config.params_dtype))
            tensor_parallel.set_tensor_model_parallel_attributes(self.softmax_offset, True, 0, 1)

    def _mask(self, q_pos, k_pos):
        allowed = super()._mask(q_pos, k_pos)
        if self.window is not None:
            allowed = allowed & (q_pos[:, None] - k_pos[None, :] <= self.window)
        return allowed

    def _attend(self, q, k, v, allowed):
        if allowed is None:
            positions = torch.arange(q.shape[-2], device=q.device)
            allowed = self._mask(positions, positions)
        if self.softmax_offset is None:
            return super()._attend(q, k, v, allowed)
        return sink_softmax_attention(q, k, v, allowed, self.softmax_offset, self.softmax_scale,
                                      self.dropout if self.training else 0.0)

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        """The sinks, split over TP by heads, under Megatron's own name (softmax_offset)."""
        state = {} if self.softmax_offset is None else {"softmax_offset": self.softmax_offset}
        return make_sharded_tensors_for_checkpoint(state, prefix, {"softmax_offset": 0}, sharded_offsets,
                                                   tp_group=self.tp_group,
                                                   dp_cp_group=(metadata or {}).get("dp_cp_group"))
