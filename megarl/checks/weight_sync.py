"""End-to-end check of a weight sync: perturb the actor as training would, sync, generate, and
compare the rollout engine's sampled-token log-probs with the actor's teacher-forced ones.

Owns the machinery behind scripts/verify_sync.py and the resharding tests.
"""

import zlib
from typing import List

import torch
import torch.distributed as dist

from megarl.checks import parity
from megarl.models import weight_tables
from megarl.models.hf_config import ModelArch
from megarl.models.param_layout import param_slots
from megarl.parallel_state import megatron_groups
from megarl.rollout.engine import RolloutSample, SamplingConfig


@torch.no_grad()
def perturb(chunks: List[torch.nn.Module], arch: ModelArch, scale: float, seed: int) -> None:
    """Add relative noise to every parameter. Noise is drawn from the full tensor's name and the
    shard's TP rank (0 for TP-replicated tensors), so every replica -- DP, CP, the TP copies of
    a norm, a tied embedding's two copies -- gets the same noise and replicas stay identical."""
    for slot, param in param_slots(chunks):
        shard = slot.tp_rank if slot.tp_dim is not None else 0
        key = f"{weight_tables.entry_of(arch, slot.canonical, 'policy').megatron}/{shard}"
        generator = torch.Generator().manual_seed(seed ^ zlib.crc32(key.encode()))
        noise = torch.randn(param.shape, generator=generator, dtype=torch.float32)
        param.add_((scale * param.float().abs().mean() * noise).to(param.dtype))


def all_samples(mine: List[RolloutSample]) -> List[RolloutSample]:
    """Every engine's samples on every rank, deduplicated across the TP ranks of one engine."""
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    seen, samples = set(), []
    for rank_samples in everyone:
        for sample in rank_samples:
            key = (tuple(sample.prompt_ids), tuple(sample.response_ids), sample.prompt_index)
            if key not in seen:
                seen.add(key)
                samples.append(sample)
    return samples


def actor_logprob_diff(chunks, arch: ModelArch, samples: List[RolloutSample], multiple: int) -> float:
    """Max |rollout log-prob - actor teacher-forced log-prob| over all sampled tokens. Collective."""
    length = max(len(s.prompt_ids) + len(s.response_ids) for s in samples)
    length = -(-length // multiple) * multiple
    tokens = torch.zeros(len(samples), length, dtype=torch.long)  # right padding: causal, unseen
    for i, s in enumerate(samples):
        ids = s.prompt_ids + s.response_ids
        tokens[i, :len(ids)] = torch.tensor(ids)
    result = parity.megatron_run(chunks, arch, tokens, backward=False)
    diff = torch.zeros(1, dtype=torch.float64)
    if megatron_groups.is_last_stage():
        for i, s in enumerate(samples):
            start = len(s.prompt_ids) - 1  # position p predicts token p + 1
            positions = torch.arange(start, start + len(s.response_ids))
            actor = result.logprobs[i, positions, torch.tensor(s.response_ids)]
            diff[0] = max(diff[0], float((actor.double() - s.logprobs.double()).abs().max()))
    dist.all_reduce(diff, op=dist.ReduceOp.MAX)
    return float(diff[0])


def fixed_prompts(vocab_size: int, count: int, seed: int = 0) -> List[List[int]]:
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, 9, (count,), generator=generator)
    return [torch.randint(0, vocab_size, (int(n),), generator=generator).tolist() for n in lengths]


def default_sampling(max_new_tokens: int, seed: int) -> SamplingConfig:
    return SamplingConfig(n=2, temperature=1.0, max_new_tokens=max_new_tokens, seed=seed)
