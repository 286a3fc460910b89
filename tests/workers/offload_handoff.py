"""Worker: offload/reload of real Megatron TrainStates at one layout, and (with --vllm) the whole
handoff (sync and generation) around the real VLLMEngine. Every rank saves its observations to
OUT_DIR/<case>_rank<r>.pt; it asserts nothing itself, so the test reports what differed.

Each case: one actor update, snapshot, offload (params=False, then params=True) with the freed
storages and byte counts recorded, reload and compare to the snapshot bit for bit, a second
update, and the same two updates on a fresh actor that never offloaded. A case with Megatron's
optimizer offload (a fraction > 0) also records where the state that offload keeps in host
memory was and what it held, before, during and after the handoff.
"""

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
from synthetic_batch import synthetic_batch  # noqa: I001 (next to this script)

from megarl.actor import offload as offload_mod
from megarl.actor.actor import Actor
from megarl.actor.config import ActorConfig
from megarl.actor.optimizer import NO_OFFLOAD, OptimConfig, OptimizerOffloadConfig
from megarl.critic.config import CriticConfig
from megarl.critic.critic import Critic
from megarl.models.hf.config import load_arch
from megarl.models.hf.weights_io import load_hf_weights
from megarl.models.megatron.builder import build_model
from megarl.parallel_state import megatron_groups
from megarl.parallel_state.dims import ParallelDims
from megarl.resharding.sync import sync_weights
from megarl.rollout.engine import SamplingConfig
from megarl.rollout.vllm.engine import VLLMEngine


def new_actor(dims, hf_dir, dtype, distributed_optimizer, fraction=0.0):
    arch = load_arch(hf_dir, dtype)
    chunks = build_model(arch, dims, perform_initialization=False)
    load_hf_weights(chunks, arch, hf_dir)
    optim = OptimConfig(lr=1e-3, use_distributed_optimizer=distributed_optimizer)
    offload = OptimizerOffloadConfig(fraction=fraction) if fraction else NO_OFFLOAD
    return Actor(chunks, arch, ActorConfig(optim=optim, optimizer_offload=offload)), arch


def inner_optimizers(state):
    return [o.optimizer for o in getattr(state.optimizer, "chained_optimizers", [state.optimizer])
            if getattr(o, "optimizer", None) is not None]


def snapshot(state) -> dict:
    """Clones of everything offload may touch, by a stable name."""
    out = {f"param/{i}/{name}": p.detach().clone()
           for i, chunk in enumerate(state.model) for name, p in chunk.named_parameters()}
    for k, inner in enumerate(inner_optimizers(state)):
        for g, group in enumerate(inner.param_groups):
            for j, p in enumerate(group["params"]):
                out[f"main/{k}/{g}/{j}"] = p.detach().clone()
                for key, value in inner.state[p].items():
                    out[f"state/{k}/{g}/{j}/{key}"] = value.clone()
    return out


def first_difference(a: dict, b: dict):
    """Name of the first entry that is not bit-equal (None: all equal)."""
    if a.keys() != b.keys():
        return f"keys differ: {sorted(a.keys() ^ b.keys())[:3]}"
    return next((k for k in a if not torch.equal(a[k], b[k])), None)


def optimizer_kinds(state):
    """(main params, moments) the device holds and the state Megatron's optimizer offload keeps in
    host memory, read from each HybridDeviceOptimizer's own maps (which parameters it gave a host
    copy, their fp32 copies, its state per parameter), not from the sub-optimizer lists that
    offload.py reads. Without the offload: every main param and moment, nothing on the host."""
    main, moments, host = [], [], []
    for inner in inner_optimizers(state):
        hybrid = hasattr(inner, "gpu_params_map_cpu_copy")
        for group in inner.param_groups:
            for p in group["params"]:
                values = [v for k, v in inner.state.get(p, {}).items() if k not in ("step", "master_param")]
                if hybrid and p in inner.gpu_params_map_cpu_copy:
                    host += [inner.gpu_params_map_cpu_copy[p], *values]
                else:
                    main.append(inner.param_to_fp32_param[p] if hybrid else p)
                    moments += values
        if hybrid:
            host += list(inner.cpu_copy_map_grad.values())  # the pinned gradients it steps from
    return main, moments, host


def tensors(state):
    """The tensors whose storages offload frees, by kind (and the host-resident state it must
    leave alone, where there is some), and the byte counts expected from the buffer and optimizer
    sizes (independently of offload's storage bookkeeping)."""
    buffers = [b for chunk in state.model for b in chunk.buffers + chunk.expert_parallel_buffers]
    main, moments, host = optimizer_kinds(state)
    params = [p for chunk in state.model for p in chunk.parameters()]
    param_bytes = sum(b.param_data.numel() * b.param_data.element_size() if b.param_data is not None
                      else sum(p.numel() * p.element_size() for p in b.params) for b in buffers)
    counts = dict(main_numel=sum(p.numel() for p in main),
                  moment_numel=sum(v.numel() for v in moments),
                  host_bytes=sum(t.numel() * t.element_size() for t in host),
                  host_main_numel=sum(p.numel() for inner in inner_optimizers(state)
                                      for p in getattr(inner, "gpu_params_map_cpu_copy", {}).values()),
                  grad_bytes=sum(b.grad_data.numel() * b.grad_data.element_size() for b in buffers),
                  param_bytes=param_bytes, param_dtype=str(params[0].dtype),
                  expert_buffers=sum(len(chunk.expert_parallel_buffers) for chunk in state.model))
    kinds = dict(main=main, moments=moments, params=params, grads=[b.grad_data for b in buffers])
    if host:
        kinds["host"] = host
    return kinds, counts


def where(ts) -> list:
    """(data pointer, storage bytes) of each tensor: equal lists mean the same storages, whole."""
    return [(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()) for t in ts]


def unmoved(host, storages, values) -> dict:
    """Whether the host-resident tensors `host` still have the storages `where` found and the
    values cloned before (not read where a storage changed: a freed one would crash the read)."""
    same = where(host) == storages
    return dict(same_storages=same,
                same_values=same and all(torch.equal(t, v) for t, v in zip(host, values, strict=True)))


def freed(kinds: dict) -> dict:
    """For each kind: True if every tensor's storage is 0 bytes, False if none is, else 'mixed'
    (or 'none' for no tensors)."""
    out = {}
    for kind, ts in kinds.items():
        sizes = {t.untyped_storage().size() == 0 for t in ts}
        out[kind] = sizes.pop() if len(sizes) == 1 else ("mixed" if sizes else "none")
    return out


def case(dims, hf_dir, dtype, distributed_optimizer, fraction, max_len):
    actor, arch = new_actor(dims, hf_dir, dtype, distributed_optimizer, fraction)
    batch = actor.logprobs(synthetic_batch(arch.vocab_size, max_len=max_len))
    actor.update(batch)
    before = snapshot(actor.state)
    kinds, counts = tensors(actor.state)
    host = kinds.get("host", [])
    host_before, host_values = where(host), [t.clone() for t in host]
    result = dict(counts=counts, offloads={})
    for params in (False, True):
        start = time.perf_counter()
        offloaded = offload_mod.offload(actor.state, params=params)
        offload_s = time.perf_counter() - start
        during = freed(kinds)
        host_during = unmoved(host, host_before, host_values)
        host_bytes, freed_bytes = offloaded.host_bytes, offloaded.freed_bytes
        start = time.perf_counter()
        offload_mod.reload(offloaded)
        result["offloads"][params] = dict(
            host_bytes=host_bytes, freed_bytes=freed_bytes, freed=during,
            after_reload=freed(kinds), offload_s=offload_s, reload_s=time.perf_counter() - start,
            difference=first_difference(before, snapshot(actor.state)),
            grads_zero=all(bool((g == 0).all()) for g in kinds["grads"]),
            host_resident=dict(during=host_during, after=unmoved(host, host_before, host_values)))
    actor.update(batch)
    reference, _ = new_actor(dims, hf_dir, dtype, distributed_optimizer, fraction)
    reference.update(batch)
    after_one = snapshot(reference.state)
    reference.update(batch)
    result.update(second_update_difference=first_difference(snapshot(reference.state),
                                                            snapshot(actor.state)),
                  first_update_difference=first_difference(after_one, before),
                  second_update_moved=first_difference(after_one, snapshot(reference.state)))
    return result


def refusal(call):
    """What the engine says to `call()` (None: it ran)."""
    try:
        call()
        return None
    except RuntimeError as error:
        return str(error)


def handoff(dims, hf_dir, max_len):
    """device_to_engine around the real engine, with a spy recording each call in order and
    whether the actor's optimizer moments and parameters were freed at that moment."""
    actor, arch = new_actor(dims, hf_dir, None, True)
    critic = Critic(build_model(arch, dims, role="value"), CriticConfig())
    batch = actor.logprobs(synthetic_batch(arch.vocab_size, max_len=max_len))
    actor.update(batch)
    critic.update(critic.values(batch))  # so that it has optimizer moments to move
    states = [actor.state, critic.state]
    before = [snapshot(s) for s in states]
    kinds, counts = zip(*[tensors(s) for s in states])
    engine = VLLMEngine(hf_dir, dtype=arch.dtype, kv_cache_gib=1, max_model_len=64, load_format="auto")
    prompts = [[1, 2, 3, 4], [9, 8, 7]]
    greedy = SamplingConfig(temperature=0.0, max_new_tokens=6)
    sync_weights(actor.state.chunks, arch, engine)  # the updated actor's weights, before any handoff
    expected_tokens = [s.response_ids for s in engine.generate(prompts, greedy)]
    engine.release_memory()  # as setup leaves it

    calls = []

    def spied(name, original):
        def recorded(*args, **kwargs):
            actor_freed = freed(kinds[0])
            calls.append((name, actor_freed["moments"], actor_freed["params"]))
            return original(*args, **kwargs)
        return recorded

    for name in ("resume_memory", "generate", "release_memory"):
        setattr(engine, name, spied(name, getattr(engine, name)))
    for name in ("offload", "reload"):
        setattr(offload_mod, name, spied(name, getattr(offload_mod, name)))
    sync = spied("sync", lambda: sync_weights(actor.state.chunks, arch, engine))

    with offload_mod.device_to_engine(actor.state, [critic.state], engine, sync,
                                      offload_params=True) as freed_bytes:
        inside = dict(actor=freed(kinds[0]), critic=freed(kinds[1]))
        tokens = [s.response_ids for s in engine.generate(prompts, greedy)]
    result = dict(calls=list(calls), freed_bytes=freed_bytes, inside=inside, counts=counts,
                  tokens_equal=tokens == expected_tokens, tokens=tokens,
                  after=[freed(k) for k in kinds],
                  differences=[first_difference(b, snapshot(s)) for b, s in zip(before, states)])
    # Released: updates and generation refused; weights woken: generation waits for the KV cache,
    # then for a sync (the woken weights are stale).
    result["released_refusals"] = dict(weight_update=refusal(lambda: engine.begin_weight_update({})),
                                       generate=refusal(lambda: engine.generate(prompts, greedy)))
    engine.resume_memory(kv_cache=False)
    result["kv_cache_refusal"] = refusal(lambda: engine.generate(prompts, greedy))
    engine.resume_memory()
    result["stale_refusal"] = refusal(lambda: engine.generate(prompts, greedy))
    report = sync_weights(actor.state.chunks, arch, engine)
    result.update(synced=report.params_synced == report.params_expected > 0,
                  synced_tokens_equal=[s.response_ids for s in engine.generate(prompts, greedy)]
                  == expected_tokens)
    engine.release_memory()
    calls.clear()
    try:
        with offload_mod.device_to_engine(actor.state, [critic.state], engine, sync,
                                          offload_params=False):
            raise RuntimeError("generation failed")
    except RuntimeError:
        pass
    result.update(raised_calls=list(calls), raised_after=[freed(k) for k in kinds],
                  raised_differences=[first_difference(b, snapshot(s)) for b, s in zip(before, states)])
    actor.update(batch)  # training goes on after the handoff
    engine.shutdown()
    return result


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--layout", required=True, help="JSON of ParallelDims fields")
    parser.add_argument("--cases", required=True,
                        help="JSON list of [name, hf_dir, dtype or null, use_distributed_optimizer, "
                             "optimizer_offload.fraction]")
    parser.add_argument("--vllm", default=None, help="HF dir: also run the handoff around vLLM")
    parser.add_argument("--out-dir", required=True)
    parser.add_argument("--max-len", type=int, default=32)
    args = parser.parse_args()
    world = megatron_groups.init_distributed()
    dims = ParallelDims(world_size=world, **json.loads(args.layout))
    megatron_groups.initialize(dims)
    rank = dist.get_rank()
    results = {name: case(dims, hf_dir, dtype, dist_opt, fraction, args.max_len)
               for name, hf_dir, dtype, dist_opt, fraction in json.loads(args.cases)}
    if args.vllm:
        results["handoff"] = handoff(dims, args.vllm, args.max_len)
    for name, result in results.items():
        torch.save(result, os.path.join(args.out_dir, f"{name}_rank{rank}.pt"))
    megatron_groups.destroy()


if __name__ == "__main__":
    main()
