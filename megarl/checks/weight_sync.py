"""End-to-end check of a weight sync: perturb the actor as training would, sync, generate, and
compare the rollout engine's sampled-token log-probs with the actor's teacher-forced ones.

Owns the machinery behind scripts/verify_sync.py and the resharding tests. The actor's side is
`Actor.logprobs` on the samples laid out as the trainer lays them out (rollout.collect.to_batch),
so the check covers the path training takes. Does not own the sync (resharding) or generation.
"""

import json
import os
import zlib
from typing import List, Optional, Tuple

import torch
import torch.distributed as dist

from megarl.actor.actor import Actor
from megarl.actor.config import ActorConfig, BatchingConfig
from megarl.algos import mismatch
from megarl.models.hf.config import ModelArch, load_hf_config
from megarl.models.lora import peft_io
from megarl.models.megatron.param_layout import weight_slots
from megarl.models.weights import tables as weight_tables
from megarl.parallel_state import megatron_groups
from megarl.rollout.collect import to_batch
from megarl.rollout.completion import Completion
from megarl.rollout.engine import RolloutSample, SamplingConfig
from megarl.rollout.prompts import Prompt
from megarl.rollout.turns import TurnDriver


@torch.no_grad()
def perturb(chunks: List[torch.nn.Module], arch: ModelArch, scale: float, seed: int) -> None:
    """Add relative noise to every parameter. Noise is drawn from the full tensor's name and the
    shard's TP rank (0 for TP-replicated tensors), so every replica -- DP, CP, the TP copies of
    a norm, a tied embedding's two copies -- gets the same noise and replicas stay identical."""
    for slot, param in weight_slots(chunks):
        shard = slot.tp_rank if slot.tp_dim is not None else 0
        key = f"{weight_tables.entry_of(arch, slot.canonical, 'policy').megatron}/{shard}"
        generator = torch.Generator().manual_seed(seed ^ zlib.crc32(key.encode()))
        noise = torch.randn(param.shape, generator=generator, dtype=torch.float32)
        param.add_((scale * param.float().abs().mean() * noise).to(param.dtype))


@torch.no_grad()
def perturb_adapters(chunks: List[torch.nn.Module], scale: float, seed: int) -> None:
    """perturb's noise on every LoRA adapter tensor instead (what a training step moves when
    only the adapters train), drawn from the PEFT name and the shard, so replicas stay equal."""
    for shard, tensor in peft_io.local_shards(chunks):
        key = f"{shard.slot}"
        generator = torch.Generator().manual_seed(seed ^ zlib.crc32(key.encode()))
        noise = torch.randn(tensor.shape, generator=generator, dtype=torch.float32)
        tensor.add_((scale * tensor.float().abs().mean() * noise).to(tensor.dtype))


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


def checking_actor(chunks: List[torch.nn.Module], arch: ModelArch, router_replay: str = "off") -> Actor:
    """An Actor over `chunks` for its log-probs only (it never steps). The interleaved pipeline
    schedule needs at least as many micro-batches as pipeline stages."""
    pp = megatron_groups.pipeline().size
    return Actor(chunks, arch, ActorConfig(batching=BatchingConfig(micro_batches=pp),
                                           router_replay=router_replay))


def actor_logprob_diff(actor: Actor, samples: List[RolloutSample]) -> float:
    """Max |rollout log-prob - actor log-prob| over all sampled tokens. Collective."""
    batch = to_batch(samples, rewards=torch.zeros(len(samples)))
    ours = actor.logprobs(batch).old_logprobs  # [N, L]
    sampled = batch.loss_mask.bool()
    return float((ours.double() - batch.rollout_logprobs.double())[sampled].abs().max())


def routing_replay_report(chunks: List[torch.nn.Module], arch: ModelArch,
                          samples: List[RolloutSample], version: Optional[int] = None) -> dict:
    """{router replay "off" and "rollout" (R3): the max |rollout - actor| log-prob difference over
    the sampled tokens (`version`: those that policy version sampled, the actor's), and how often
    the experts the actor used differ from the engine's (algos/mismatch.py)}, for samples from an
    engine started with return_routing. Collective."""
    batch = to_batch(samples, rewards=torch.zeros(len(samples)))
    sampled = batch.loss_mask.bool()
    if version is not None:
        sampled &= batch.rollout_versions == version
    report = {}
    for mode in ("off", "rollout"):
        scored = checking_actor(chunks, arch, router_replay=mode).logprobs(batch)
        diff = (scored.old_logprobs.double() - batch.rollout_logprobs.double())[sampled].abs()
        report[mode] = {"max_abs_logprob_diff": float(diff.max()),
                        **mismatch.routing_mismatch(batch.rollout_routing, scored.old_routing)}
    return report


def streamed_across_push(engine, prompts: List[List[int]], sampling: SamplingConfig,
                         steps_before: int, push) -> Tuple[List[RolloutSample], int]:
    """(every engine's samples on every rank, requests interrupted) of `prompts` streamed turn by
    turn as rollout ranks of their own stream them (TurnDriver, "continue"), version 0 until
    `push()` (a weight sync to version 1) after `steps_before` engine steps: the requests
    unfinished then go on with the new weights, their prefix recomputed by them."""
    driver, completion = TurnDriver(engine, "continue", version=0), Completion()
    completion.start(driver, 0, [Prompt("", ids, None) for ids in prompts], sampling)
    for _ in range(steps_before):
        completion.step(driver)
    driver.pause()
    push()
    driver.weights_updated(1)
    while completion.busy():
        completion.step(driver)
    return all_samples(completion.finished(driver, 0)), driver.interrupted


def fp32_mismatches(engine, arch: ModelArch) -> List[str]:
    """This rank's engine tensors whose dtype the sync and memory planners get wrong: held in fp32
    by the engine but counted in the model's dtype, or the other way round
    (models/weights/engine_fp32.py); [] in an fp32 model, where every tensor is fp32."""
    from megarl.resharding.sync import layout_tensors

    if arch.dtype == "float32":
        return []
    rank = dist.get_rank() if dist.is_initialized() else 0
    tensors = layout_tensors(arch, engine.weight_layout())[0].get(rank, ())
    live = engine.live_weights()
    return sorted(t.name for t in tensors
                  if t.name in live and (live[t.name].dtype == torch.float32) != t.fp32)


def export_synced(chunks: List[torch.nn.Module], arch: ModelArch, hf_dir: str,
                  samples: List[RolloutSample], out_dir: str) -> None:
    """Collective: OUT/hf, the model the engine was synced to (HF format), and OUT/samples.json
    (rank 0), the samples it generated after the sync, for a fresh engine to reproduce."""
    from megarl.resharding.hf_export import export_hf

    export_hf(chunks, arch, load_hf_config(hf_dir), hf_dir, os.path.join(out_dir, "hf"))
    if dist.get_rank() == 0:
        with open(os.path.join(out_dir, "samples.json"), "w") as f:
            json.dump([sample_record(s) for s in samples], f)


def sample_record(sample: RolloutSample) -> dict:
    return {"prompt_ids": sample.prompt_ids, "prompt_index": sample.prompt_index,
            "response_ids": sample.response_ids, "logprobs": sample.logprobs.tolist()}


def fixed_prompts(vocab_size: int, count: int, seed: int = 0) -> List[List[int]]:
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, 9, (count,), generator=generator)
    return [torch.randint(0, vocab_size, (int(n),), generator=generator).tolist() for n in lengths]


def default_sampling(max_new_tokens: int, seed: int) -> SamplingConfig:
    return SamplingConfig(n=2, temperature=1.0, max_new_tokens=max_new_tokens, seed=seed)
