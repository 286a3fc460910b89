"""The actor: log-probs of a batch (old policy, reference policy) and the policy update.

Owns the policy loss of one micro-batch (an algos policy loss, optional entropy bonus and KL
loss, aggregated as this micro-batch's share of the global loss) and the update's order of
steps. Forward/backward, packing and the optimizer are shared with the critic.
"""

import contextlib
from functools import partial
from typing import List

import torch

from megarl.actor.config import ActorConfig, require_norm_tokens
from megarl.actor.optimizer import TrainState
from megarl.actor.packing import PackedMicroBatch, unpack_predictions
from megarl.actor.passes import global_counts, local_micro_batches, mean_over_steps
from megarl.actor.reference import ReferenceWeights
from megarl.actor.router_replay import RoutingReplay
from megarl.actor.schedule import forward_only_result, full_pack, run_micro_batches, share_rows, sum_metrics
from megarl.algos import rollout_correction
from megarl.algos.aggregation import aggregate
from megarl.algos.kl import kl as kl_estimate
from megarl.algos.policy_losses import POLICY_LOSSES
from megarl.algos.vocab_parallel import logprobs_and_entropy
from megarl.batch.rollout_batch import RolloutBatch
from megarl.models.hf.config import ModelArch
from megarl.parallel_state import megatron_groups

METRICS = ("loss", "policy_loss", "entropy", "kl", "clip_fraction")


class Actor:
    def __init__(self, chunks: List[torch.nn.Module], arch: ModelArch, config: ActorConfig):
        require_norm_tokens(config.loss_aggregation, config.norm_tokens, "actor")
        self.arch, self.config = arch, config
        chunks[0].config.moe_aux_loss_coeff = 0.0
        self.state = TrainState(chunks, config.optim, config.optimizer_offload)
        if config.router_replay != "off" and not arch.num_experts:
            raise ValueError(f"actor.router_replay={config.router_replay!r} needs a MoE model; "
                             f"{arch.family} has no routers: set actor.router_replay=off")
        # Every MoE actor records its routing where the engine's is there to compare with.
        self.routing = RoutingReplay(chunks, arch.num_layers, arch.moe_topk) if arch.num_experts else None
        self.reference = None

    def snapshot_reference(self) -> None:
        """Keep the current weights as the reference policy (a host copy, not a second model)."""
        self.reference = ReferenceWeights(self.state.chunks)

    # ---- log-probs ----------------------------------------------------------------------

    def _token_logprobs(self, mb: PackedMicroBatch, output: torch.Tensor, entropy_grad: bool = False):
        """output [1, t/cp, V/tp] -> (log-probs, entropy) [n, W], column i for token i; the
        entropy carries a gradient only with `entropy_grad` (a loss with an entropy bonus)."""
        tp = megatron_groups.tensor().size
        group = megatron_groups.tensor().group if tp > 1 else None
        logprobs, entropy = logprobs_and_entropy(output[0], mb.targets[0].to(output.device),
                                                 group, self.arch.vocab_size, entropy_grad=entropy_grad)
        both = full_pack(torch.stack([logprobs, entropy], -1), mb)  # [t, 2]
        return unpack_predictions(both, mb).unbind(-1)

    def _report_logprobs(self, mb, output):
        logprobs, _ = self._token_logprobs(mb, output)
        return forward_only_result(output, logprobs=logprobs)

    @torch.no_grad()
    def logprobs(self, batch: RolloutBatch, reference: bool = False) -> RolloutBatch:
        """The batch with old_logprobs (or ref_logprobs) [N, L] filled. A MoE actor's old-policy
        pass routes through batch.rollout_routing with router_replay "rollout" (R3), and fills
        old_routing with the experts its routers used when replay is "old" or the engine's
        routing is there to compare with. The reference routes on its own. Collective."""
        if reference and self.reference is None:
            raise ValueError("no reference policy: call snapshot_reference() before training")
        micro_batches = local_micro_batches(batch, torch.arange(batch.size), self.config.batching)
        mode = self.config.router_replay
        if mode == "rollout" and batch.rollout_routing is None and not reference:
            raise ValueError("actor.router_replay='rollout' needs batch.rollout_routing: the engine "
                             "returns it when started with return_routing (a run does so itself)")
        routing = self.routing is not None and not reference
        replay = batch.rollout_routing if routing and mode == "rollout" else None
        record = routing and (mode == "old" or batch.rollout_routing is not None)
        around = None
        if replay is not None or record:
            self.routing.begin(replay, record)
            around = self.routing.around
        self.state.train_mode(False)
        try:
            with self.reference.swapped_in(self.state.chunks) if reference else contextlib.nullcontext():
                outputs = run_micro_batches(self.state.model, micro_batches,
                                            lambda mb: partial(self._report_logprobs, mb),
                                            forward_only=True, around_forward=around)
        except BaseException:
            if around is not None:
                self.routing.abort()
            raise
        used = self.routing.end(micro_batches, batch.size, batch.width) if around else None
        logprobs = share_rows([o["logprobs"] for o in outputs], micro_batches,
                              (batch.size, batch.width), torch.float32, megatron_groups.device())
        fields = {"ref_logprobs" if reference else "old_logprobs": logprobs.cpu()}
        if used is not None:
            fields["old_routing"] = used
        return batch.with_fields(**fields)

    # ---- update -------------------------------------------------------------------------

    def _policy_loss(self, batch: RolloutBatch, counts: dict, weights, mb: PackedMicroBatch, output):
        cfg = self.config
        logprobs, entropy = self._token_logprobs(mb, output, entropy_grad=bool(cfg.entropy_coeff))  # [n, W]
        rows = batch.select(mb.rows)
        width = mb.width
        mask = rows.loss_mask[:, :width].to(logprobs.device)
        old = rows.old_logprobs[:, :width].to(logprobs.device)
        is_weights = None if weights is None else weights[mb.rows][:, :width].to(old.device)
        per_token, clipped = POLICY_LOSSES[cfg.policy_loss](
            logprobs=logprobs, old_logprobs=old, advantages=rows.advantages[:, :width].to(old.device),
            mask=mask, eps_clip_low=cfg.eps_clip_low, eps_clip_high=cfg.eps_clip_high,
            dual_clip=cfg.dual_clip, is_weights=is_weights)
        share = partial(aggregate, mask=mask, **counts)
        policy_loss = share(per_token, mode=cfg.loss_aggregation)
        entropy_share = share(entropy, mode=cfg.loss_aggregation)
        loss = policy_loss - cfg.entropy_coeff * entropy_share if cfg.entropy_coeff else policy_loss
        kl = torch.zeros(())
        if cfg.kl_loss_coeff:
            kl = share(kl_estimate(logprobs, rows.ref_logprobs[:, :width].to(old.device), cfg.kl_estimator,
                                   cfg.kl_clamp), mode=cfg.loss_aggregation)
            loss = loss + cfg.kl_loss_coeff * kl
        metrics = {"loss": loss, "policy_loss": policy_loss, "entropy": entropy_share, "kl": kl,
                   "clip_fraction": share(clipped, mode="token-mean")}
        # Every CP rank computes this same loss from the gathered pack; their gradients are summed.
        cp = megatron_groups.context().size
        return loss / cp, torch.tensor(1, dtype=torch.int), {k: v.detach() for k, v in metrics.items()}

    def update(self, batch: RolloutBatch) -> dict:
        """Epochs x mini-batches of optimizer steps on `batch` (needs old_logprobs, advantages,
        and ref_logprobs / rollout_logprobs / the replayed routing when their switches are on).
        The rollout correction's rejected tokens leave the loss (its loss mask is the kept
        tokens) and its weights multiply the policy loss. Returns metrics averaged over the
        optimizer steps; `skipped` is the fraction of them skipped for a non-finite loss or
        gradient. Collective."""
        self._check_inputs(batch)
        weights = None
        correction = self.config.rollout_correction.correction
        if correction.active:
            weights, keep = rollout_correction.apply(batch.old_logprobs, batch.rollout_logprobs,
                                                     batch.loss_mask, correction)
            batch = batch.with_fields(loss_mask=keep.to(batch.loss_mask.dtype))
        return mean_over_steps(batch, self.config.batching, partial(self._step, batch, weights))

    def _step(self, batch: RolloutBatch, weights, rows: torch.Tensor) -> dict:
        micro_batches = local_micro_batches(batch, rows, self.config.batching)
        counts = global_counts(batch, rows, self.config.norm_tokens)
        mode = self.config.router_replay
        around = None
        if mode != "off":
            self.routing.begin(batch.rollout_routing if mode == "rollout" else batch.old_routing,
                               record=False)
            around = self.routing.around
        try:
            with self._aux_loss_scaled(len(micro_batches)):
                outputs, grad_norm, lr, skipped = self.state.step(
                    micro_batches, partial(partial, self._policy_loss, batch, counts, weights), around)
        finally:
            if around is not None:
                self.routing.end(micro_batches, batch.size, batch.width)
        return {**sum_metrics(outputs, METRICS), "grad_norm": grad_norm, "lr": lr,
                "skipped": float(skipped)}

    @contextlib.contextmanager
    def _aux_loss_scaled(self, micro_batches: int):
        """Megatron adds each micro-batch's router aux loss unscaled when losses are summed;
        dividing the coefficient by micro-batches x DP makes it the mean over them."""
        config = self.state.chunks[0].config
        config.moe_aux_loss_coeff = self.config.router_aux_loss_coeff / (
            micro_batches * megatron_groups.data().size)
        try:
            yield
        finally:
            config.moe_aux_loss_coeff = 0.0

    def _check_inputs(self, batch: RolloutBatch) -> None:
        cfg = self.config
        needed = {"old_logprobs": True, "advantages": True, "ref_logprobs": bool(cfg.kl_loss_coeff),
                  "rollout_logprobs": cfg.rollout_correction.correction.active,
                  "old_routing": cfg.router_replay == "old",
                  "rollout_routing": cfg.router_replay == "rollout"}
        missing = [name for name, want in needed.items() if want and getattr(batch, name) is None]
        if missing:
            raise ValueError(f"actor update needs batch fields {missing} (given this ActorConfig: "
                             f"kl_loss_coeff={cfg.kl_loss_coeff}, rollout_correction="
                             f"{cfg.rollout_correction}, router_replay={cfg.router_replay!r})")

