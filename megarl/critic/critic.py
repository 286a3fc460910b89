"""The critic: values of a batch and the value update, on the value model (GPTModel + ValueHead).

Owns the value loss of one micro-batch (clipped, aggregated as its share of the global loss).
Packing, the forward/backward schedule and the optimizer are the actor's, shared.
"""

from functools import partial
from typing import List

import torch

from megarl.actor.config import require_norm_tokens
from megarl.actor.optimizer import TrainState
from megarl.actor.packing import PackedMicroBatch, unpack_predictions
from megarl.actor.passes import global_counts, local_micro_batches, mean_over_steps
from megarl.actor.schedule import forward_only_result, full_pack, run_micro_batches, share_rows, sum_metrics
from megarl.algos.aggregation import aggregate
from megarl.algos.value_loss import clipped_value_loss
from megarl.batch.rollout_batch import RolloutBatch
from megarl.critic.config import CriticConfig
from megarl.parallel_state import megatron_groups

METRICS = ("value_loss", "value_clip_fraction")


class Critic:
    def __init__(self, chunks: List[torch.nn.Module], config: CriticConfig):
        require_norm_tokens(config.aggregation, config.norm_tokens, "critic")
        self.config = config
        chunks[0].config.moe_aux_loss_coeff = 0.0
        self.state = TrainState(chunks, config.optim, config.optimizer_offload)

    def _token_values(self, mb: PackedMicroBatch, output: torch.Tensor) -> torch.Tensor:
        """output [1, t/cp, 1] -> values [n, W]: column i is the value of the state before token i."""
        return unpack_predictions(full_pack(output[0, :, 0].float(), mb), mb)

    def _report_values(self, mb, output):
        values = self._token_values(mb, output)
        return forward_only_result(output, values=values)

    @torch.no_grad()
    def values(self, batch: RolloutBatch) -> RolloutBatch:
        """The batch with values [N, L] filled. Collective."""
        micro_batches = local_micro_batches(batch, torch.arange(batch.size), self.config.batching)
        self.state.train_mode(False)
        outputs = run_micro_batches(self.state.model, micro_batches,
                                    lambda mb: partial(self._report_values, mb), forward_only=True)
        values = share_rows([o["values"] for o in outputs], micro_batches, (batch.size, batch.width),
                            torch.float32, megatron_groups.device())
        return batch.with_fields(values=values.cpu() * batch.loss_mask)

    def _value_loss(self, batch: RolloutBatch, counts: dict, mb: PackedMicroBatch, output):
        values = self._token_values(mb, output)
        rows = batch.select(mb.rows)
        width = mb.width
        mask = rows.loss_mask[:, :width].to(values.device)
        per_token, clipped = clipped_value_loss(
            values, rows.values[:, :width].to(values.device), rows.returns[:, :width].to(values.device),
            mask, self.config.value_clip)
        share = partial(aggregate, mask=mask, **counts)
        loss = share(per_token, mode=self.config.aggregation)
        metrics = {"value_loss": loss.detach(),
                   "value_clip_fraction": share(clipped, mode="token-mean").detach()}
        return loss / megatron_groups.context().size, torch.tensor(1, dtype=torch.int), metrics

    def update(self, batch: RolloutBatch) -> dict:
        """Optimizer steps on the clipped value loss (needs values and returns). Collective."""
        if batch.values is None or batch.returns is None:
            raise ValueError("critic update needs batch.values (Critic.values) and batch.returns "
                             "(from the advantage estimator)")
        return mean_over_steps(batch, self.config.batching, partial(self._step, batch))

    def _step(self, batch: RolloutBatch, rows: torch.Tensor) -> dict:
        micro_batches = local_micro_batches(batch, rows, self.config.batching)
        counts = global_counts(batch, rows, self.config.norm_tokens)
        outputs, grad_norm, lr, skipped = self.state.step(
            micro_batches, partial(partial, self._value_loss, batch, counts))
        return {**sum_metrics(outputs, METRICS), "grad_norm": grad_norm, "lr": lr,
                "skipped": float(skipped)}
