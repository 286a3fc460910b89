"""Numerical parity of a sharded Megatron model with Hugging Face transformers.

Owns the check behind scripts/verify_conversion.py and the layout tests: on a fixed token batch
at the current layout, the next-token log-probs, the mean next-token loss and the gradients of
every full parameter under HF names; and the same three from an HF transformers model as the
independent reference.

Our side is the trainer's own code, not a second forward: log-probs come from `Actor.logprobs`,
gradients from one `Actor.update` with CISPO, unit advantages and the policy's own log-probs as
the old ones. CISPO's gradient is -sg(clip(ratio)) * A * grad log p; at ratio 1 and A = 1 that
is -grad log p per token, so under token-mean aggregation the update's backward is the gradient
of the mean next-token NLL, reduced over micro-batches, DP and CP exactly as in training. The
optimizer step that follows never clips and leaves the gradients in place; the weights it moves
are not used again. Does not own the model's code paths (actor, critic) or checkpoints (models).
"""

import functools
from dataclasses import dataclass, replace
from typing import Dict, List

import torch

from megarl.actor.actor import Actor
from megarl.actor.config import ActorConfig, BatchingConfig
from megarl.actor.optimizer import OptimConfig
from megarl.batch.rollout_batch import RolloutBatch
from megarl.models.hf.config import ModelArch, arch_from_hf_config
from megarl.models.hf.weights_io import gather_hf_tensors
from megarl.models.lora import peft_io
from megarl.models.megatron.builder import build_model
from megarl.models.weights import checkpoint
from megarl.parallel_state.dims import ParallelDims


@dataclass
class ParityResult:
    logprobs: torch.Tensor  # [B, S] column i: log p(token i | tokens before it); column 0 is 0
    loss: float  # mean next-token NLL over the batch
    grads: Dict[str, torch.Tensor]  # HF name -> full gradient (empty without backward)


def fixed_tokens(vocab_size: int, batch: int, seq: int, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (batch, seq), generator=generator)  # [B, S]


def scored_batch(tokens: torch.Tensor) -> RolloutBatch:
    """tokens [B, S] as a RolloutBatch in which every token after the first is scored."""
    rows, seq = tokens.shape
    mask = torch.ones(rows, seq)
    mask[:, 0] = 0.0  # nothing predicts the first token
    return RolloutBatch(tokens=tokens, lengths=torch.full((rows,), seq), loss_mask=mask,
                        group_ids=torch.arange(rows))


def actor_run(chunks: List[torch.nn.Module], arch: ModelArch, tokens: torch.Tensor,
              backward: bool, micro_batches: int, adapters: bool = False) -> ParityResult:
    """The trainer's path on `tokens` [B, S] at the current layout, in `micro_batches` micro-batches
    per data-parallel rank (see the module docstring for the gradient); `adapters`: the gradients
    of the LoRA adapters (PEFT names) instead of the model's. Collective."""
    # A plain optimizer leaves every rank its fully reduced gradients (a distributed one keeps a
    # shard); an infinite clip never rescales them. lr is irrelevant: the moved weights are unused.
    optim = OptimConfig(clip_grad=float("inf"), use_distributed_optimizer=False)
    actor = Actor(chunks, arch, ActorConfig(policy_loss="cispo", optim=optim,
                                            batching=BatchingConfig(micro_batches=micro_batches)))
    batch = actor.logprobs(scored_batch(tokens))
    mask = batch.loss_mask
    loss = float(-(batch.old_logprobs * mask).sum() / mask.sum())
    grads = {}
    if backward:
        actor.update(batch.with_fields(advantages=mask))
        main_grad = lambda p: p.main_grad  # noqa: E731
        grads = (peft_io.gather(chunks, main_grad) if adapters
                 else gather_hf_tensors(chunks, arch, tensor_of=main_grad))
    return ParityResult(logprobs=batch.old_logprobs, loss=loss, grads=grads)


def hf_run(hf_dir: str, tokens: torch.Tensor, backward: bool, adapter_dir: str = None) -> ParityResult:
    """The reference: HF transformers, fp32, eager attention; with `adapter_dir`, PEFT's LoRA
    model on it, and the gradients are the adapters' (PEFT's saved names)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        hf_dir, dtype=torch.float32, attn_implementation="eager")
    if adapter_dir:
        import peft

        model = peft.PeftModel.from_pretrained(model, adapter_dir, is_trainable=True)
    model.train(backward)
    with torch.set_grad_enabled(backward):
        every = torch.log_softmax(model(tokens).logits.float(), dim=-1)  # [B, S, V]
        picked = every[:, :-1].gather(-1, tokens[:, 1:, None])[..., 0]  # [B, S-1]
        loss = -picked.mean()
    grads = {}
    if backward:
        loss.backward()
        named = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
        grads = ({n.replace(".default.", "."): g for n, g in named.items()} if adapter_dir
                 else _hub_named(model, named))
    logprobs = torch.nn.functional.pad(picked.detach(), (1, 0))  # [B, S], as ParityResult.logprobs
    return ParityResult(logprobs=logprobs, loss=float(loss.detach()), grads=grads)


@functools.lru_cache(maxsize=16)
def _hf_reference(hf_dir: str, vocab_size: int, batch: int, seq: int, backward: bool,
                  adapter_dir: str = None) -> ParityResult:
    """hf_run on fixed_tokens, kept per process (a parity worker checks each of its checkpoints
    at many layouts, and the reference does not depend on the layout). Tiny models only: each
    entry holds a full set of gradients."""
    return hf_run(hf_dir, fixed_tokens(vocab_size, batch, seq), backward, adapter_dir)


@torch.no_grad()
def _hub_named(model, tensors: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """Name tensors as the checkpoint on disk does: transformers 5 fuses MoE experts in memory
    and splits them again on save; its own reverse conversion does the renaming."""
    from transformers.core_model_loading import revert_weight_conversion

    named = {k: v.contiguous() for k, v in revert_weight_conversion(model, tensors).items()}
    if model.config.tie_word_embeddings:
        named.pop("lm_head.weight", None)
    return named


def checkpoint_arch(megatron_dir: str) -> ModelArch:
    """The model a megarl Megatron checkpoint holds, from the HF config saved with it."""
    return arch_from_hf_config(checkpoint.read_model_file(megatron_dir)["hf_config"])


def check_checkpoint(hf_dir: str, megatron_dir: str, dims: ParallelDims, grads: bool,
                     batch: int = 4, seq: int = 32, micro_batches: int = 2, adapter_dir: str = None):
    """Load `megatron_dir` at the current layout and compare with HF transformers on `hf_dir`;
    with `adapter_dir` (a PEFT LoRA folder), both carry its adapters and the gradients compared
    are the adapters'. Collective; every rank returns the same (summary dict, our ParityResult)."""
    arch = checkpoint_arch(megatron_dir)
    chunks = build_model(arch, dims, perform_initialization=False)
    checkpoint.load(chunks, megatron_dir)
    if adapter_dir:
        peft_io.start(chunks, arch, replace(peft_io.read_config(adapter_dir, arch), init=adapter_dir))
    tokens = fixed_tokens(arch.vocab_size, batch, seq)
    ours = actor_run(chunks, arch, tokens, backward=grads, micro_batches=micro_batches,
                     adapters=adapter_dir is not None)
    ref = _hf_reference(hf_dir, arch.vocab_size, batch, seq, grads, adapter_dir)
    summary = {"layout": dims.describe(), "family": arch.family,
               "max_abs_logprob_diff": float((ours.logprobs.double() - ref.logprobs.double()).abs().max()),
               "loss": ours.loss, "hf_loss": ref.loss,
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
