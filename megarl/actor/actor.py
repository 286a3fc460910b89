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
from megarl.algos.aggregation import aggregate
from megarl.algos.kl import kl as kl_estimate
from megarl.algos.policy_losses import POLICY_LOSSES, truncated_is_weights
from megarl.algos.vocab_parallel import logprobs_and_entropy
from megarl.batch.rollout_batch import RolloutBatch
from megarl.models.hf_config import ModelArch
from megarl.parallel_state import megatron_groups

METRICS = ("loss", "policy_loss", "entropy", "kl", "clip_fraction")


class Actor:
    def __init__(self, chunks: List[torch.nn.Module], arch: ModelArch, config: ActorConfig):
        require_norm_tokens(config.loss_aggregation, config.norm_tokens, "actor")
        self.arch, self.config = arch, config
        chunks[0].config.moe_aux_loss_coeff = 0.0
        self.state = TrainState(chunks, config.optim)
        self.replay = (RoutingReplay(chunks, arch.num_layers, arch.moe_topk)
                       if config.router_replay else None)
        self.reference = None

    def snapshot_reference(self) -> None:
        """Keep the current weights as the reference policy (a host copy, not a second model)."""
        self.reference = ReferenceWeights(self.state.chunks)

    # ---- log-probs ----------------------------------------------------------------------

    def _token_logprobs(self, mb: PackedMicroBatch, output: torch.Tensor):
        """output [1, t/cp, V/tp] -> (log-probs, entropy) [n, W], column i for token i."""
        tp = megatron_groups.tensor().size
        group = megatron_groups.tensor().group if tp > 1 else None
        logprobs, entropy = logprobs_and_entropy(output[0].float(), mb.targets[0].to(output.device),
                                                 group, self.arch.vocab_size)
        both = full_pack(torch.stack([logprobs, entropy], -1), mb)  # [t, 2]
        return unpack_predictions(both, mb).unbind(-1)

    def _report_logprobs(self, mb, output):
        logprobs, _ = self._token_logprobs(mb, output)
        return forward_only_result(output, logprobs=logprobs)

    @torch.no_grad()
    def logprobs(self, batch: RolloutBatch, reference: bool = False) -> RolloutBatch:
        """The batch with old_logprobs (or ref_logprobs) [N, L] filled. With router replay on, the
        old-policy pass replays batch.routed_experts when given (e.g. recorded by the rollout
        engine) and otherwise records them. The reference routes on its own. Collective."""
        if reference and self.reference is None:
            raise ValueError("no reference policy: call snapshot_reference() before training")
        micro_batches = local_micro_batches(batch, torch.arange(batch.size), self.config.batching)
        routing = self.replay is not None and not reference
        replay = routing and batch.routed_experts is not None
        record = routing and not replay
        around = None
        if record:
            self.replay.start_recording()
            around = self.replay.record_around
        elif replay:
            self.replay.start_replay(batch.routed_experts)
            around = self.replay.replay_around
        self.state.train_mode(False)
        try:
            with self.reference.swapped_in(self.state.chunks) if reference else contextlib.nullcontext():
                outputs = run_micro_batches(self.state.model, micro_batches,
                                            lambda mb: partial(self._report_logprobs, mb),
                                            forward_only=True, around_forward=around)
        finally:
            if replay:
                self.replay.stop_replay()
        logprobs = share_rows([o["logprobs"] for o in outputs], micro_batches,
                              (batch.size, batch.width), torch.float32, megatron_groups.device())
        fields = {"ref_logprobs" if reference else "old_logprobs": logprobs.cpu()}
        if record:
            fields["routed_experts"] = self.replay.finish_recording(micro_batches, batch.size,
                                                                    batch.width)
        return batch.with_fields(**fields)

    # ---- update -------------------------------------------------------------------------

    def _policy_loss(self, batch: RolloutBatch, counts: dict, mb: PackedMicroBatch, output):
        cfg = self.config
        logprobs, entropy = self._token_logprobs(mb, output)  # [n, W]
        rows = batch.select(mb.rows)
        width = mb.width
        mask = rows.loss_mask[:, :width].to(logprobs.device)
        old = rows.old_logprobs[:, :width].to(logprobs.device)
        is_weights = None
        if cfg.tis_cap is not None:
            is_weights = truncated_is_weights(old, rows.rollout_logprobs[:, :width].to(old.device),
                                              cfg.tis_cap)
        per_token, clipped = POLICY_LOSSES[cfg.policy_loss](
            logprobs=logprobs, old_logprobs=old, advantages=rows.advantages[:, :width].to(old.device),
            mask=mask, eps_clip_low=cfg.eps_clip_low, eps_clip_high=cfg.eps_clip_high,
            dual_clip=cfg.dual_clip, is_weights=is_weights)
        share = partial(aggregate, mask=mask, **counts)
        policy_loss = share(per_token, mode=cfg.loss_aggregation)
        entropy_share = share(entropy, mode=cfg.loss_aggregation)
        loss = policy_loss - cfg.entropy_coeff * entropy_share
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
        and ref_logprobs / rollout_logprobs / routed_experts when their switches are on).
        Returns metrics averaged over the optimizer steps; `skipped` is the fraction of them
        skipped for a non-finite loss or gradient. Collective."""
        self._check_inputs(batch)
        return mean_over_steps(batch, self.config.batching, partial(self._step, batch))

    def _step(self, batch: RolloutBatch, rows: torch.Tensor) -> dict:
        micro_batches = local_micro_batches(batch, rows, self.config.batching)
        counts = global_counts(batch, rows, self.config.norm_tokens)
        around = None
        if self.replay is not None:
            self.replay.start_replay(batch.routed_experts)
            around = self.replay.replay_around
        try:
            with self._aux_loss_scaled(len(micro_batches)):
                outputs, grad_norm, lr, skipped = self.state.step(
                    micro_batches, partial(partial, self._policy_loss, batch, counts), around)
        finally:
            if self.replay is not None:
                self.replay.stop_replay()
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
                  "rollout_logprobs": cfg.tis_cap is not None, "routed_experts": cfg.router_replay}
        missing = [name for name, want in needed.items() if want and getattr(batch, name) is None]
        if missing:
            raise ValueError(f"actor update needs batch fields {missing} (given this ActorConfig: "
                             f"kl_loss_coeff={cfg.kl_loss_coeff}, tis_cap={cfg.tis_cap}, "
                             f"router_replay={cfg.router_replay})")

