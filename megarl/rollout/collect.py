"""From prompts to a RolloutBatch on every rank: each engine's producer samples the engine's share
of the prompts, every rank receives all samples, responses are decoded and scored.

Owns collecting one draw over the world's engines (split and gathered as shares.py does) and
laying samples out as right-padded rows with the rollout log-probs aligned to their tokens.
Does not own generation (the engine, the producer) or what a reward means (megarl/rewards).
"""

from dataclasses import dataclass, field
from typing import Dict, List

import torch

from megarl.algos.shaping import informative_groups
from megarl.batch.rollout_batch import RolloutBatch
from megarl.rewards.functions import Request
from megarl.rewards.scorer import Scorer
from megarl.rollout.engine import RolloutSample, SamplingConfig
from megarl.rollout.producer import SampleProducer, produce
from megarl.rollout.prompts import Prompt
from megarl.rollout.shares import gathered, share
from megarl.rollout.turns import TurnDriver


@dataclass(frozen=True)
class Collected:
    batch: RolloutBatch
    responses: List[str]  # decoded, in batch row order
    reward_failures: int  # scored 0: raised, returned a non-number, or timed out
    reward_timeouts: int
    first_reward_error: str
    truncated: int  # responses cut at max_new_tokens
    reward_extras: Dict[str, torch.Tensor]  # a dict result's other numbers per row (NaN: none)
    events: Dict[str, int] = field(default_factory=dict)  # the samples' agent events, summed


def all_samples(driver: TurnDriver, producer: SampleProducer, prompts: List[Prompt],
                sampling: SamplingConfig) -> List[RolloutSample]:
    """Every engine's samples on every rank, ordered by global prompt index; `driver` drives this
    rank's engine. Collective."""
    placement = driver.engine.placement
    mine, sampling = share(placement, len(prompts), sampling)
    samples = produce(producer, driver, [prompts[i] for i in mine], sampling) if mine else []
    return gathered(placement, mine, samples)


def _routing(samples: List[RolloutSample], width: int):
    """The engine's routing [N, width, layers, k] (-1 where none; input-token aligned), or None
    when the engine returned none."""
    given = [s.routed_experts is not None for s in samples]
    if not any(given):
        return None
    if not all(given):
        raise RuntimeError(f"the engine returned routing for {sum(given)} of {len(samples)} samples")
    first = samples[0].routed_experts
    out = torch.full((len(samples), width, *first.shape[1:]), -1, dtype=first.dtype)
    for row, s in enumerate(samples):
        fed = len(s.prompt_ids) + len(s.response_ids) - 1  # the last sampled token is never fed
        if s.routed_experts.shape != (fed, *first.shape[1:]):
            raise RuntimeError(f"sample {row}: routing {tuple(s.routed_experts.shape)} for {fed} "
                               f"tokens fed through the engine; expected ({fed}, "
                               f"{', '.join(map(str, first.shape[1:]))})")
        out[row, :fed] = s.routed_experts
    return out


def _versions(samples: List[RolloutSample], width: int):
    """Each response token's policy version [N, width] (-1 elsewhere), or None when the samples
    carry none (synchronous rollouts)."""
    if all(s.versions is None for s in samples):
        return None
    out = torch.full((len(samples), width), -1, dtype=torch.int64)
    for row, s in enumerate(samples):
        if s.versions is None or s.versions.shape != (len(s.response_ids),):
            raise RuntimeError(f"sample {row}: versions "
                               f"{None if s.versions is None else tuple(s.versions.shape)} for "
                               f"{len(s.response_ids)} response tokens")
        out[row, len(s.prompt_ids):len(s.prompt_ids) + len(s.response_ids)] = s.versions
    return out


def to_batch(samples: List[RolloutSample], rewards: torch.Tensor) -> RolloutBatch:
    lengths = torch.tensor([len(s.prompt_ids) + len(s.response_ids) for s in samples])
    width = int(lengths.max())
    tokens = torch.zeros(len(samples), width, dtype=torch.long)
    mask = torch.zeros(len(samples), width)
    rollout_logprobs = torch.zeros(len(samples), width)
    for row, s in enumerate(samples):
        p, r = len(s.prompt_ids), len(s.response_ids)
        tokens[row, :p + r] = torch.tensor(s.prompt_ids + s.response_ids)
        mask[row, p:p + r] = 1.0 if s.response_mask is None else s.response_mask
        rollout_logprobs[row, p:p + r] = s.logprobs
    return RolloutBatch(tokens=tokens, lengths=lengths, loss_mask=mask,
                        group_ids=torch.tensor([s.prompt_index for s in samples]),
                        rewards=rewards, rollout_logprobs=rollout_logprobs,
                        rollout_routing=_routing(samples, width),
                        rollout_versions=_versions(samples, width))


def _widen(tensor: torch.Tensor, width: int, fill) -> torch.Tensor:
    """[N, L, ...] right-padded with `fill` to [N, width, ...]."""
    out = tensor.new_full((tensor.shape[0], width, *tensor.shape[2:]), fill)
    out[:, :tensor.shape[1]] = tensor
    return out


def collect(driver: TurnDriver, producer: SampleProducer, prompts: List[Prompt],
            sampling: SamplingConfig, tokenizer, scorer: Scorer) -> Collected:
    """Collective over the world: every rank returns the same batch."""
    return scored(all_samples(driver, producer, prompts, sampling), prompts, tokenizer, scorer)


def scored(samples: List[RolloutSample], prompts: List[Prompt], tokenizer, scorer: Scorer) -> Collected:
    """The samples (answering `prompts`, by prompt_index) decoded, scored (once, collective) and
    laid out."""
    empty = [s for s in samples if not s.response_ids]
    if empty:
        raise RuntimeError(f"{len(empty)} samples have empty responses; raise max_new_tokens or check "
                           "that the prompt does not end the sequence")
    responses = [tokenizer.decode(s.response_ids, skip_special_tokens=True) for s in samples]
    asked = [prompts[s.prompt_index] for s in samples]
    scores = scorer.score([Request(response, p.answer, p.data_source, p.extra_info, p.messages,
                                   tuple(s.trajectory or ()))
                           for response, p, s in zip(responses, asked, samples)],
                          [s.prompt_ids + s.response_ids for s in samples])
    return Collected(to_batch(samples, scores.rewards), responses, scores.failures, scores.timeouts,
                     scores.first_error or "", sum(s.finish_reason == "length" for s in samples),
                     scores.extras, _summed([s.events for s in samples]))


def _summed(counts: List[Dict[str, int]]) -> Dict[str, int]:
    out: Dict[str, int] = {}
    for count in counts:
        for name, value in count.items():
            out[name] = out.get(name, 0) + value
    return out


def _concat(parts: List[Collected]) -> Collected:
    """Rounds of rollouts as one, rows right-padded to the widest; group ids of later rounds are
    offset past the earlier rounds' prompts (`prompts_per_round` each)."""
    width = max(p.batch.width for p in parts)
    rows = [_widen(p.batch.tokens, width, 0) for p in parts]
    padded = {name: torch.cat([_widen(getattr(p.batch, name), width, 0) for p in parts])
              for name in ("loss_mask", "rollout_logprobs")}
    for name in ("rollout_routing", "rollout_versions"):  # -1: none (routing), not a response token
        if getattr(parts[0].batch, name) is not None:
            padded[name] = torch.cat([_widen(getattr(p.batch, name), width, -1) for p in parts])
    offset = 0
    group_ids = []
    for p in parts:
        group_ids.append(p.batch.group_ids + offset)
        offset += int(p.batch.group_ids.max()) + 1
    batch = RolloutBatch(tokens=torch.cat(rows), lengths=torch.cat([p.batch.lengths for p in parts]),
                         group_ids=torch.cat(group_ids), rewards=torch.cat([p.batch.rewards for p in parts]),
                         **padded)
    names = sorted({k for p in parts for k in p.reward_extras})
    extras = {k: torch.cat([p.reward_extras.get(k, torch.full((len(p.responses),), float("nan")))
                            for p in parts]) for k in names}
    return Collected(batch, [r for p in parts for r in p.responses],
                     sum(p.reward_failures for p in parts), sum(p.reward_timeouts for p in parts),
                     next((p.first_reward_error for p in parts if p.first_reward_error), ""),
                     sum(p.truncated for p in parts), extras,
                     _summed([p.events for p in parts]))


def keep_informative(parts: List[Collected], groups: int) -> Collected:
    """DAPO dynamic sampling: the first `groups` groups whose rewards differ, in round order;
    when the rounds hold fewer, the first uninformative groups fill the batch up to `groups` so
    every step trains on the same number of sequences."""
    merged = _concat(parts)
    batch = merged.batch
    informative = informative_groups(batch.rewards, batch.group_ids)
    order = torch.unique(batch.group_ids)  # sorted: round order, then prompt order
    first = {int(g): bool(informative[batch.group_ids == g][0]) for g in order}
    chosen = ([g for g in first if first[g]] + [g for g in first if not first[g]])[:groups]
    rows = torch.nonzero(torch.isin(batch.group_ids, torch.tensor(chosen))).flatten()
    kept = batch.select(rows)
    width = int(kept.lengths.max())
    kept = kept.with_fields(**{name: getattr(kept, name)[:, :width]
                               for name in ("tokens", "loss_mask", "rollout_logprobs", "rollout_routing",
                                            "rollout_versions")
                               if getattr(kept, name) is not None})
    return Collected(kept, [merged.responses[i] for i in rows.tolist()], merged.reward_failures,
                     merged.reward_timeouts, merged.first_reward_error, merged.truncated,
                     {k: v[rows] for k, v in merged.reward_extras.items()}, merged.events)
