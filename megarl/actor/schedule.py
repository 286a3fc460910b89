"""Running a model (actor or critic) over packed micro-batches with Megatron's schedules.

Owns: the forward step that feeds a thd pack to a GPTModel chunk (any PP/VPP schedule through
`get_forward_backward_func`), bringing per-token outputs back to full pack order across context
parallel ranks, and sharing per-row results of this rank's micro-batches with every rank.
Does not own losses (actor.py, critic.py) or the optimizer (optimizer.py).
"""

from typing import Callable, List, Optional

import torch
import torch.distributed as dist
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.utils import get_attr_wrapped_model

from megarl.actor.packing import PackedMicroBatch, local_positions
from megarl.models.megatron import expert_bias
from megarl.models.megatron.portable_layers import gather_from_context_parallel
from megarl.parallel_state import megatron_groups


def packed_seq_params(mb: PackedMicroBatch, device) -> PackedSeqParams:
    cu, cu_padded = mb.cu_seqlens.to(device), mb.cu_seqlens_padded.to(device)
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                           cu_seqlens_q_padded=cu_padded, cu_seqlens_kv_padded=cu_padded,
                           max_seqlen_q=mb.max_seqlen, max_seqlen_kv=mb.max_seqlen)


def router_padding(chunk: torch.nn.Module, mb: PackedMicroBatch, device) -> torch.Tensor:
    """The pack's padding at the tokens this rank's routers see: this CP rank's, then, under
    sequence parallelism, this TP rank's contiguous share of them."""
    padding = mb.padding[0].to(device)
    tp = megatron_groups.tensor()
    if get_attr_wrapped_model(chunk, "config").sequence_parallel:
        padding = padding.chunk(tp.size)[tp.rank]
    return padding


def forward_only_result(output: torch.Tensor, **reported: torch.Tensor) -> tuple:
    """What Megatron's schedule takes from a loss function on a forward-only pass: a zero loss
    tied to the output, a count of one, and the (detached) tensors to report."""
    return output.sum() * 0.0, torch.tensor(1, dtype=torch.int), {k: v.detach() for k, v in reported.items()}


def run_micro_batches(model: List[torch.nn.Module], micro_batches: List[PackedMicroBatch],
                      make_loss: Callable[[PackedMicroBatch], Callable], forward_only: bool,
                      around_forward: Optional[Callable] = None) -> list:
    """One pass of Megatron's forward_backward_func over `micro_batches`. `make_loss(mb)` gives
    the loss function of that micro-batch's output; `around_forward(chunk, mb, forward)` may wrap
    each chunk's forward (router replay). Returns the loss functions' third outputs on the last
    pipeline stage (empty elsewhere). Collective over the whole model-parallel layout."""
    device = next(model[0].parameters()).device

    def forward_step(data_iterator, chunk):
        mb = next(data_iterator)

        def forward():
            expert_bias.set_padding(chunk, router_padding(chunk, mb, device))
            return chunk(mb.tokens.to(device), None, None,
                         packed_seq_params=packed_seq_params(mb, device))

        output = around_forward(chunk, mb, forward) if around_forward else forward()
        return output, make_loss(mb)

    iterators = [iter(micro_batches) for _ in model]
    return get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iterators if len(model) > 1 else iterators[0],
        model=model if len(model) > 1 else model[0],
        num_microbatches=len(micro_batches),
        seq_length=max(mb.tokens.shape[1] for mb in micro_batches),
        micro_batch_size=1, forward_only=forward_only,
    )


def full_pack(local: torch.Tensor,  # [t/cp, ...] this CP rank's tokens
              mb: PackedMicroBatch) -> torch.Tensor:
    """[t, ...] in pack order. Differentiable: a loss computed identically on every CP rank from
    the result must be divided by cp (the gather's backward sums the ranks' gradients)."""
    cp = megatron_groups.context().size
    if cp == 1:
        return local
    gathered = gather_from_context_parallel(local, megatron_groups.context().group)
    order = torch.cat([local_positions(mb.cu_seqlens_padded, cp, r) for r in range(cp)])
    return gathered[torch.argsort(order).to(gathered.device)]


def owns_results() -> bool:
    """One rank per data-parallel rank reports: last stage, TP rank 0, CP rank 0."""
    return (megatron_groups.is_last_stage() and megatron_groups.tensor().rank == 0
            and megatron_groups.context().rank == 0)


def share_rows(per_mb: List[torch.Tensor],  # [n, W, ...] per micro-batch of this rank
               micro_batches: List[PackedMicroBatch], shape, dtype, device) -> torch.Tensor:
    """Every rank gets [N, L, ...]: the reporting rank of each DP rank fills its micro-batches'
    rows, the rest contribute zeros to one all-reduce."""
    out = torch.zeros(shape, dtype=dtype, device=device)
    if owns_results():
        for values, mb in zip(per_mb, micro_batches):
            out[mb.rows.to(device), :values.shape[1]] = values.to(dtype)
    dist.all_reduce(out)
    return out


def sum_metrics(per_mb: List[dict], keys) -> dict:
    """Sum each metric over micro-batches and data-parallel ranks (shares of global means)."""
    totals = torch.zeros(len(keys), dtype=torch.float64,
                         device=megatron_groups.device())
    if owns_results():
        for metrics in per_mb:
            totals += torch.tensor([float(metrics[k]) for k in keys], dtype=torch.float64,
                                   device=totals.device)
    dist.all_reduce(totals)
    return dict(zip(keys, totals.tolist()))
