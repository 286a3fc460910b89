"""Numerical parity of a sharded Megatron model with Hugging Face transformers.

Owns the check behind scripts/verify_conversion.py and the layout tests: a forward (and
optionally backward) on a fixed token batch at the current layout, returning the full-vocabulary
log-probs, the mean next-token loss and the gradients of every full parameter under HF names;
and the same three numbers from an HF transformers model as the independent reference.
"""

from dataclasses import dataclass
from functools import partial
from typing import Dict, List, Optional

import torch
import torch.distributed as dist
from megatron.core import tensor_parallel
from megatron.core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
)
from megatron.core.pipeline_parallel import get_forward_backward_func

from megarl.models import checkpoint
from megarl.models.builder import build_model
from megarl.models.hf_config import ModelArch, arch_from_hf_config
from megarl.models.hf_io import gather_hf_tensors
from megarl.models.portable_layers import cp_positions
from megarl.parallel_state import megatron_groups
from megarl.parallel_state.dims import ParallelDims


@dataclass
class ParityResult:
    logprobs: Optional[torch.Tensor]  # [B, S, V] on last-stage ranks, else None
    loss: float                       # mean next-token NLL over the batch
    grads: Dict[str, torch.Tensor]    # HF name -> full gradient (empty without backward)


def fixed_tokens(vocab_size: int, batch: int, seq: int, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (batch, seq), generator=generator)  # [B, S]


def next_token_targets(tokens: torch.Tensor):
    """Targets and mask for next-token prediction; the last position predicts nothing."""
    targets = torch.roll(tokens, -1, dims=1)  # [B, S]
    mask = torch.ones_like(tokens, dtype=torch.float32)
    mask[:, -1] = 0.0
    return targets, mask


def cp_local(x: torch.Tensor, cp_rank: int, cp_size: int) -> torch.Tensor:
    """[B, S, ...] -> this CP rank's load-balanced [B, S/cp, ...] slice."""
    if cp_size == 1:
        return x
    return x.index_select(1, cp_positions(x.shape[1] // cp_size, cp_rank, cp_size, x.device))


def _cp_gather(x: torch.Tensor) -> torch.Tensor:
    """Inverse of cp_local over the CP group: [B, S/cp, ...] -> [B, S, ...]."""
    cp_size = megatron_groups.context().size
    if cp_size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(cp_size)]
    dist.all_gather(parts, x.contiguous(), group=megatron_groups.context().group)
    full = torch.empty(x.shape[0], x.shape[1] * cp_size, *x.shape[2:], dtype=x.dtype)
    for rank, part in enumerate(parts):
        full[:, cp_positions(x.shape[1], rank, cp_size, x.device)] = part
    return full


def _loss_func(vocab_size, targets, mask, logits):
    # logits [b, s/cp, Vp/tp]: gather the vocabulary and drop Megatron's padding so the
    # softmax normalizes over exactly the HF vocabulary.
    full = tensor_parallel.gather_from_tensor_model_parallel_region(logits)[..., :vocab_size]
    logprobs = torch.log_softmax(full.float(), dim=-1)  # [b, s/cp, V]
    nll = -logprobs.gather(-1, targets.unsqueeze(-1)).squeeze(-1)  # [b, s/cp]
    loss_sum = (nll * mask).sum()
    num_tokens = mask.sum().to(torch.int)
    # Megatron divides the returned loss in place; report copies.
    return loss_sum, num_tokens, {"logprobs": logprobs.detach(), "loss_sum": loss_sum.detach().clone(),
                                  "num_tokens": num_tokens}


def wrap_ddp(chunks: List[torch.nn.Module]) -> List[DistributedDataParallel]:
    # Per-token loss: gradients are summed over DP x CP and divided once by the global token
    # count, so the result cannot depend on how tokens were split. DDP reads the flag when built.
    config = chunks[0].config
    config.finalize_model_grads_func = finalize_model_grads
    config.calculate_per_token_loss = True
    ddp_config = DistributedDataParallelConfig(overlap_grad_reduce=False,
                                               use_distributed_optimizer=False)
    return [DistributedDataParallel(c.config, ddp_config, c) for c in chunks]


def _schedule(model: List[torch.nn.Module], batches: List[dict], make_loss, backward: bool):
    """Run Megatron's forward_backward_func (any PP/VPP schedule) over `batches`, one per
    micro-batch; `make_loss(batch)` returns the loss function of that micro-batch's output."""

    def forward_step(data_iterator, chunk):
        data = next(data_iterator)
        return chunk(data["tokens"], None, None), make_loss(data)

    iterators = [iter(batches) for _ in model]
    return get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iterators if len(model) > 1 else iterators[0],
        model=model if len(model) > 1 else model[0],
        num_microbatches=len(batches), seq_length=batches[0]["tokens"].shape[1],
        micro_batch_size=batches[0]["tokens"].shape[0], forward_only=not backward,
    )


def megatron_run(chunks: List[torch.nn.Module], arch: ModelArch, tokens: torch.Tensor,
                 backward: bool, micro_batches: int = 1) -> ParityResult:
    """Forward (and backward) on `tokens` [B, S] at the current layout, in `micro_batches`
    pipeline micro-batches. Collective."""
    if tokens.shape[0] % micro_batches:
        raise ValueError(f"batch {tokens.shape[0]} is not divisible by micro_batches {micro_batches}")
    cp_rank, cp_size = megatron_groups.context().rank, megatron_groups.context().size
    targets, mask = next_token_targets(tokens)
    batches = [dict(tokens=cp_local(t, cp_rank, cp_size), targets=cp_local(g, cp_rank, cp_size),
                    mask=cp_local(m, cp_rank, cp_size))
               for t, g, m in zip(tokens.chunk(micro_batches), targets.chunk(micro_batches),
                                  mask.chunk(micro_batches))]
    model = wrap_ddp(chunks) if backward else chunks
    for chunk in model:
        chunk.train() if backward else chunk.eval()
        if backward:
            chunk.zero_grad_buffer()
    outputs = _schedule(model, batches, lambda data: partial(
        _loss_func, arch.vocab_size, data["targets"], data["mask"]), backward)
    totals = torch.zeros(2, dtype=torch.float64)
    logprobs = None
    if megatron_groups.is_last_stage():
        logprobs = torch.cat([_cp_gather(out["logprobs"]) for out in outputs])
        totals += torch.tensor([sum(float(o["loss_sum"]) for o in outputs),
                                sum(float(o["num_tokens"]) for o in outputs)])
        if megatron_groups.tensor().rank == 0 and megatron_groups.data().rank == 0:
            dist.all_reduce(totals, group=megatron_groups.context().group)
            if cp_rank != 0:
                totals.zero_()
        else:
            totals.zero_()
    dist.all_reduce(totals)  # exactly one rank contributes: last stage, tp 0, dp 0, cp 0
    grads = {}
    if backward:
        grads = gather_hf_tensors(chunks, arch, tensor_of=lambda p: p.main_grad)
    return ParityResult(logprobs=logprobs, loss=float(totals[0] / totals[1]), grads=grads)


def _values_func(values):  # values [b, s/cp, 1]
    return values.sum() * 0.0, torch.tensor(1), {"values": values.squeeze(-1).detach()}


@torch.no_grad()
def megatron_values(chunks: List[torch.nn.Module], tokens: torch.Tensor) -> torch.Tensor:
    """Value-model forward on `tokens` [B, S]; returns values [B, S] on every rank. Collective."""
    cp_rank, cp_size = megatron_groups.context().rank, megatron_groups.context().size
    for chunk in chunks:
        chunk.eval()
    outputs = _schedule(chunks, [dict(tokens=cp_local(tokens, cp_rank, cp_size))],
                        lambda data: _values_func, backward=False)
    values = _cp_gather(outputs[0]["values"]) if megatron_groups.is_last_stage() else None
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, values)
    return next(v for v in everyone if v is not None)


def hf_run(hf_dir: str, tokens: torch.Tensor, backward: bool) -> ParityResult:
    """The reference: HF transformers, fp32, eager attention."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        hf_dir, dtype=torch.float32, attn_implementation="eager")
    model.train(backward)
    targets, mask = next_token_targets(tokens)
    with torch.set_grad_enabled(backward):
        logprobs = torch.log_softmax(model(tokens).logits.float(), dim=-1)
        nll = -logprobs.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        loss = (nll * mask).sum() / mask.sum()
    grads = {}
    if backward:
        loss.backward()
        grads = _hub_named(model, {n: p.grad for n, p in model.named_parameters()})
    return ParityResult(logprobs=logprobs.detach(), loss=float(loss.detach()), grads=grads)


@torch.no_grad()
def _hub_named(model, tensors: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """Name tensors as the checkpoint on disk does: transformers 5 fuses MoE experts in memory
    and splits them again on save; its own reverse conversion does the renaming."""
    from transformers.core_model_loading import revert_weight_conversion

    named = {k: v.contiguous() for k, v in revert_weight_conversion(model, tensors).items()}
    if model.config.tie_word_embeddings:
        named.pop("lm_head.weight", None)
    return named


def check_checkpoint(hf_dir: str, megatron_dir: str, dims: ParallelDims, grads: bool,
                     batch: int = 4, seq: int = 32, micro_batches: int = 2):
    """Load `megatron_dir` at the current layout and compare with HF transformers on `hf_dir`.
    Collective. Returns (summary dict, our ParityResult)."""
    arch = arch_from_hf_config(checkpoint.read_model_file(megatron_dir)["hf_config"])
    dims.check_sequence(seq)
    chunks = build_model(arch, dims, perform_initialization=False, moe_aux_loss_coeff=0.0)
    checkpoint.load(chunks, megatron_dir)
    tokens = fixed_tokens(arch.vocab_size, batch, seq)
    ours = megatron_run(chunks, arch, tokens, backward=grads, micro_batches=micro_batches)
    ref = hf_run(hf_dir, tokens, backward=grads)
    diff = torch.zeros(1, dtype=torch.float64)
    if ours.logprobs is not None:
        diff[0] = (ours.logprobs.double() - ref.logprobs.double()).abs().max()
    dist.all_reduce(diff, op=dist.ReduceOp.MAX)
    summary = {"layout": dims.describe(), "family": arch.family,
               "max_abs_logprob_diff": float(diff[0]), "loss": ours.loss, "hf_loss": ref.loss,
               "loss_rel_diff": abs(ours.loss - ref.loss) / abs(ref.loss)}
    if grads:
        mismatch = sorted(set(ref.grads) ^ set(ours.grads))
        if mismatch:
            raise RuntimeError(f"gradient names differ from HF's: {mismatch[:10]}")
        rel = {name: relative_diff(ours.grads[name], ref.grads[name]) for name in ref.grads}
        worst = max(rel, key=rel.get)
        summary.update(max_grad_rel_diff=rel[worst], worst_grad=worst, num_grads=len(rel))
    return summary, ours


def relative_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30))
