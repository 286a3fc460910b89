"""Scoring a batch once per sample: rank 0 of the default world runs the reward functions in its
pool, every other rank receives the scores (before, every rank scored every sample).

Summaries are pure: a failed or timed-out sample scores 0 and is counted; extras are per sample,
NaN where a sample's function returned none.
"""

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

import torch
import torch.distributed as dist

from megarl.rewards.functions import Request, RewardTable
from megarl.rewards.pool import Result, ScoringPool


@dataclass(frozen=True)
class Scores:
    rewards: torch.Tensor  # [N] float32
    failures: int  # samples whose function raised, returned a non-number, or timed out (scored 0)
    timeouts: int  # of those, the ones cut at the timeout
    first_error: Optional[str]  # the first failure's message, for the log
    extras: Dict[str, torch.Tensor]  # field -> [N] float32 of dict results' other numbers


def summarize(results: Sequence[Result]) -> Scores:
    names = sorted({k for r in results if r.outcome is not None for k in r.outcome.extras})
    extras = {k: torch.tensor([r.outcome.extras.get(k, float("nan")) if r.outcome else float("nan")
                               for r in results], dtype=torch.float32) for k in names}
    failed = [r for r in results if r.outcome is None]
    return Scores(torch.tensor([r.outcome.score if r.outcome else 0.0 for r in results], dtype=torch.float32),
                  len(failed), sum(r.timed_out for r in results), failed[0].error if failed else None, extras)


class Scorer:
    """Collective over the default world (a single process without one)."""

    def __init__(self, table: RewardTable, workers: int, timeout_s: float):
        self.table = table
        leader = not dist.is_initialized() or dist.get_rank() == 0
        self.pool = ScoringPool(workers, timeout_s, table.names) if leader else None

    def score(self, requests: List[Request]) -> Scores:
        scores = None
        if self.pool is not None:
            scores = summarize(self.pool.map([(self.table.name_for(r.data_source), r) for r in requests]))
        if dist.is_initialized() and dist.get_world_size() > 1:
            box = [scores]
            dist.broadcast_object_list(box, src=0)
            scores = box[0]
        return scores

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()
