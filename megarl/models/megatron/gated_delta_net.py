"""Gated DeltaNet linear attention as a Megatron-Core self-attention module (Qwen3-Next's
`linear_attn`), for megarl's portable spec, on padded [s, b, h] and packed thd inputs.

Its parameters are named and laid out as Megatron-Core's ssm/gated_delta_net.GatedDeltaNet names
them (in_proj = [q, k, v, z, beta, alpha] of this TP rank's heads; conv1d over [q, k, v];
dt_bias, A_log; out_norm; out_proj), so checkpoints match Megatron's layout. Megatron's own class
needs flash-linear-attention to be built at all and refuses packed sequences; this one computes
the rule with gated_delta_rule (flash-linear-attention's kernel when it is there, else portable
torch) and restarts the conv and the recurrent state at every packed sequence's boundary.
Owns: the layer's projections, conv, decay and gate, and the gated RMSNorm (weight * x, not
1 + weight, as Qwen3-Next's). Does not own the math (gated_delta_rule.py).
"""

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.ssm.gated_delta_net import GatedDeltaNet as MegatronGatedDeltaNet
from megatron.core.ssm.gated_delta_net import GatedDeltaNetSubmodules
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import build_module

from megarl.models.megatron import gated_delta_rule as gdr
from megarl.parallel_state import megatron_groups


def in_proj_sections(config) -> tuple:
    """Full sizes of in_proj's parts [q, k, v, z, beta, alpha] along its output dim; each part is
    sharded over TP on its own (a rank holds its heads of every part)."""
    qk = config.linear_num_key_heads * config.linear_key_head_dim
    v = config.linear_num_value_heads * config.linear_value_head_dim
    heads = config.linear_num_value_heads
    return (qk, qk, v, v, heads, heads)


def conv_sections(config) -> tuple:
    qk, _, v = in_proj_sections(config)[:3]
    return (qk, qk, v)


def _split_by_tp(param: torch.nn.Parameter, sections: tuple) -> None:
    """Tell megarl's param_layout how this parameter is cut over TP: dim 0, each section apart."""
    tensor_parallel.set_tensor_model_parallel_attributes(param, True, 0, 1)
    param.tp_sections = sections


class GatedDeltaNet(MegatronModule):
    def __init__(self, config, submodules: GatedDeltaNetSubmodules, layer_number: int = None,
                 pg_collection=None, **unused):
        super().__init__(config)
        self.layer_number = layer_number
        tp_group = pg_collection.tp if pg_collection is not None else megatron_groups.tensor().group
        tp = tp_group.size() if tp_group is not None else 1
        self.key_heads = config.linear_num_key_heads // tp
        self.value_heads = config.linear_num_value_heads // tp
        self.key_dim, self.value_dim = config.linear_key_head_dim, config.linear_value_head_dim
        sections = in_proj_sections(config)
        self.local_sections = [s // tp for s in sections]
        self.in_proj = build_module(submodules.in_proj, config.hidden_size, sum(sections), config=config,
                                    init_method=config.init_method, gather_output=False, bias=False,
                                    skip_bias_add=False, is_expert=False, tp_comm_buffer_name="fc1",
                                    tp_group=tp_group)
        self.in_proj.weight.tp_sections = sections
        conv_local = sum(conv_sections(config)) // tp
        # None: the default device, the meta device too when build_model sizes a model without memory
        device = torch.cuda.current_device() if torch.cuda.is_available() and \
            not config.use_cpu_initialization else None
        self.conv1d = torch.nn.Conv1d(conv_local, conv_local, config.linear_conv_kernel_dim,
                                      groups=conv_local, bias=False, device=device,
                                      dtype=config.params_dtype)
        _split_by_tp(self.conv1d.weight, conv_sections(config))
        self.dt_bias = torch.nn.Parameter(torch.ones(self.value_heads, dtype=config.params_dtype,
                                                     device=device))
        self.A_log = torch.nn.Parameter(torch.empty(self.value_heads, dtype=config.params_dtype,
                                                    device=device).uniform_(1, 16).log_())
        for param in (self.dt_bias, self.A_log):
            _split_by_tp(param, (config.linear_num_value_heads,))
        # The gated norm's weight is shared by every head, each TP rank's heads give it part of
        # its gradient: summed over TP as a sequence-parallel weight's is.
        self.out_norm = torch.nn.Module()
        self.out_norm.weight = torch.nn.Parameter(torch.ones(self.value_dim, dtype=config.params_dtype,
                                                             device=device))
        self.out_norm.weight.sequence_parallel = config.sequence_parallel
        self.eps = config.layernorm_epsilon
        # What Megatron's sharded_state_dict reads: distributed checkpoints split in_proj and
        # conv1d into their parts, so they load at any TP as Megatron's own GatedDeltaNet's do.
        self.pg_collection, self.tp_size, self.conv_bias = pg_collection, tp, False
        self.qk_dim, self.v_dim = sections[0], sections[2]
        self.num_value_heads, self.in_proj_dim = config.linear_num_value_heads, sum(sections)
        self.conv_dim_local_tp = conv_local
        self.out_proj = build_module(submodules.out_proj, sum(sections[2:3]), config.hidden_size,
                                     config=config, init_method=config.output_layer_init_method,
                                     bias=False, input_is_parallel=True, skip_bias_add=True,
                                     is_expert=False, tp_comm_buffer_name="fc2", tp_group=tp_group)

    sharded_state_dict = MegatronGatedDeltaNet.sharded_state_dict

    def forward(self, hidden_states, attention_mask=None, packed_seq_params=None, **unused):
        # hidden_states: padded [s(/tp), b, h]; packed thd [t(/tp), 1, h]
        mixed, _ = self.in_proj(hidden_states)  # [s, b, in/tp]
        s, b = mixed.shape[:2]
        if packed_seq_params is not None:
            cu = packed_seq_params.cu_seqlens_q_padded
            cu = (packed_seq_params.cu_seqlens_q if cu is None else cu).tolist()
            out = self._mix(mixed[:, 0], cu)[:, None]  # [t, 1, v/tp]
        else:
            rows = mixed.transpose(0, 1).reshape(b * s, -1)
            out = self._mix(rows, list(range(0, b * s + 1, s))).view(b, s, -1).transpose(0, 1)
        return self.out_proj(out.contiguous())

    def _mix(self, x, cu_seqlens):
        """x [T, in/tp] -> [T, v/tp]: conv, decay and gate, the rule, the gated norm."""
        qk, _, v, _, heads, _ = self.local_sections
        qkv, z, b, a = x.split([2 * qk + v, v, heads, heads], dim=-1)
        qkv = gdr.packed_causal_conv1d(qkv, self.conv1d.weight[:, 0], cu_seqlens)
        q, k, v = qkv.split([qk, qk, v], dim=-1)
        t = x.shape[0]
        repeat = self.value_heads // self.key_heads
        q, k = (y.reshape(t, self.key_heads, self.key_dim).repeat_interleave(repeat, dim=1)
                for y in (q, k))
        v = v.reshape(t, self.value_heads, self.value_dim)
        beta = b.sigmoid()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)  # [T, H], in fp32
        out = gdr.gated_delta_rule(q, k, v, g, beta, cu_seqlens)
        return self._gated_norm(out.view(t, self.value_heads, self.value_dim),
                                z.reshape(t, self.value_heads, self.value_dim)).reshape(t, -1)

    def _gated_norm(self, x, gate):
        """RMSNorm over each head's values (fp32, cast back before the weight), times silu(gate)."""
        dtype = x.dtype
        y = x.float()
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
        y = self.out_norm.weight * y.to(dtype)
        return (y * F.silu(gate.float())).to(dtype)
