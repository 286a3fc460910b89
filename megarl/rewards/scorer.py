"""Scoring a batch once per sample: each sample's reward is the weighted sum of its data source's
terms (spec.py). Function and judge terms run in rank 0's pool (every other rank receives the
scores); reward-model terms run on every training rank meanwhile (a forward pass is collective).

`combine` is pure: a failed or timed-out term scores 0 and its sample is counted; extras are per
sample, NaN where a sample's functions returned none. With more than one term anywhere, each
term's own score is an extra too (`term/<name>`), so a mixed reward's parts are logged.
"""

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from megarl.plugins.worker_pool import Result
from megarl.rewards.functions import Request, RewardTable
from megarl.rewards.pool import scoring_pool
from megarl.rewards.spec import RewardSpec

# A reward model's scores of some samples: (their requests, their token ids) -> [n] float32.
# Collective over the training ranks, called by every rank with the same samples.
ModelScorer = Callable[[List[Request], List[List[int]]], torch.Tensor]


@dataclass(frozen=True)
class Scores:
    rewards: torch.Tensor  # [N] float32
    failures: int  # samples with a term that raised, returned a non-number, or timed out (scored 0)
    timeouts: int  # of those, the ones cut at the timeout
    first_error: Optional[str]  # the first failure's message, for the log
    extras: Dict[str, torch.Tensor]  # field -> [N] float32 of dict results' other numbers


def combine(specs: Sequence[RewardSpec], results: Mapping[Tuple[int, str], Result],
            model_scores: Mapping[str, torch.Tensor], per_term: bool = False) -> Scores:
    """specs[i] is sample i's reward; results[(i, name)] its function terms' results;
    model_scores[path] [N] its reward models' scores (read where a sample's spec names them)."""
    n = len(specs)
    rewards = torch.zeros(n, dtype=torch.float64)
    terms: Dict[str, torch.Tensor] = {}
    extras: Dict[str, torch.Tensor] = {}
    failed, timeouts, first_error = set(), 0, None
    for i, spec in enumerate(specs):
        for term in spec.terms:
            if term.is_model:
                value = float(model_scores[term.model_path][i])
            else:
                result = results[(i, term.name)]
                if result.value is None:
                    failed.add(i)
                    timeouts += result.timed_out
                    first_error = first_error or result.error
                    value = 0.0
                else:
                    value = result.value.score
                    for name, extra in result.value.extras.items():
                        extras.setdefault(name, torch.full((n,), float("nan")))[i] = extra
            rewards[i] += term.weight * value
            terms.setdefault(f"term/{term.name}", torch.full((n,), float("nan")))[i] = value
    return Scores(rewards.float(), len(failed), timeouts, first_error,
                  {**extras, **(terms if per_term else {})})


class Scorer:
    """Collective over the default world (a single process without one), or, `collective` False,
    this process's alone (a rollout leader scoring held-out samples). `models` scores each reward
    model the table names (its directory -> its ModelScorer)."""

    def __init__(self, table: RewardTable, workers: int, timeout_s: float,
                 models: Optional[Mapping[str, ModelScorer]] = None, collective: bool = True):
        self.table, self.models, self.collective = table, dict(models or {}), collective
        missing = sorted(set(table.models) - set(self.models))
        if missing:
            raise ValueError(f"reward models {missing} are named by the reward but not loaded")
        self.per_term = any(len(spec.terms) > 1 for spec in table.specs)
        leader = not collective or not dist.is_initialized() or dist.get_rank() == 0
        self.pool = scoring_pool(workers, timeout_s, table.names) if leader else None
        # The pool's jobs are waited for in a thread while the reward models run in this one.
        self.waiter = ThreadPoolExecutor(1) if leader else None

    def score(self, requests: List[Request], token_ids: List[List[int]]) -> Scores:
        """token_ids[i]: sample i's prompt and response tokens, as the policy saw them."""
        specs = [self.table.spec_for(r.data_source) for r in requests]
        jobs = [(i, name) for i, spec in enumerate(specs) for name in spec.functions]
        pending = None
        if self.pool is not None:
            pending = self.waiter.submit(self.pool.map, [(name, requests[i]) for i, name in jobs])
        model_scores = {}
        for path in self.table.models:
            rows = [i for i, spec in enumerate(specs) if path in spec.models]
            model_scores[path] = torch.full((len(requests),), float("nan"))
            if rows:
                model_scores[path][rows] = self.models[path]([requests[i] for i in rows],
                                                             [token_ids[i] for i in rows]).float().cpu()
        scores = None
        if pending is not None:
            scores = combine(specs, dict(zip(jobs, pending.result())), model_scores, self.per_term)
        if self.collective and dist.is_initialized() and dist.get_world_size() > 1:
            box = [scores]
            dist.broadcast_object_list(box, src=0)
            scores = box[0]
        return scores

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()
            self.waiter.shutdown()
