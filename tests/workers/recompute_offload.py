"""torchrun worker: activation recompute and optimizer offload against the same model without them.

Recompute: for each case (layout, model, recompute settings), build the model twice at that layout
with the same weights, recompute off and on, run one actor update on the same packed batch, and
compare the update's loss and every full gradient; also count module forwards during the update
(recompute runs some of them again). Offload: build the actor with the on-device optimizer and
with `optimizer_offload`, take two updates each, compare the weights, and describe the optimizer
Megatron built. Rank 0 prints one JSON line. One launch serves every case: starting one costs
more than a case."""

import argparse
import json
import time

import torch
from synthetic_batch import synthetic_batch  # noqa: I001 (next to this script)

from megarl.actor.actor import Actor
from megarl.actor.config import ActorConfig, BatchingConfig
from megarl.actor.optimizer import NO_OFFLOAD, OptimConfig, OptimizerOffloadConfig
from megarl.models.hf.config import arch_from_hf_config, load_hf_config
from megarl.models.hf.weights_io import gather_hf_tensors
from megarl.models.megatron.builder import build_model
from megarl.models.megatron.config import RecomputeConfig
from megarl.parallel_state import megatron_groups
from megarl.parallel_state.dims import ParallelDims


def weights_of(chunks):
    """A copy of each chunk's state, to start a twin from before `chunks` is updated."""
    return [{k: v.clone() if torch.is_tensor(v) else v for k, v in c.state_dict().items()} for c in chunks]


def twin(arch, dims, start=None, **build):
    """The model at this layout, from `start` (weights_of at the same layout) when given."""
    chunks = build_model(arch, dims, **build)
    for chunk, state in zip(chunks, start or []):
        chunk.load_state_dict(state)
    return chunks


def actor_for(chunks, arch, offload=NO_OFFLOAD, lr=0.0, distributed=False, eps=1e-6):
    # A plain optimizer leaves every rank its fully reduced gradients, and an infinite clip never
    # rescales them; the offload cases need the distributed one (and compare two updates: eps 1e-3
    # keeps Adam from turning near-zero gradients, whose sign rounding decides, into whole steps).
    # Entropy and the router's aux loss put more terms into the backward recompute must reproduce.
    optim = OptimConfig(lr=lr or 1e-6, clip_grad=float("inf") if not lr else 1.0, adam_eps=eps,
                        use_distributed_optimizer=distributed or offload.active)
    config = ActorConfig(entropy_coeff=0.01, router_aux_loss_coeff=0.01 if arch.num_experts else 0.0,
                         batching=BatchingConfig(micro_batches=4), optim=optim, optimizer_offload=offload)
    return Actor(chunks, arch, config)


def update(actor, seed=0):
    batch = actor.logprobs(synthetic_batch(actor.arch.vocab_size, seed=seed))
    return actor.update(batch)


def counting_forwards(run, *args):
    """(run(*args), how many module forwards ran during it)."""
    calls = [0]

    def count(module, args, output):
        calls[0] += 1

    handle = torch.nn.modules.module.register_module_forward_hook(count)
    try:
        return run(*args), calls[0]
    finally:
        handle.remove()


def relative(a, b):
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30))


def recompute_case(arch, dims, settings):
    reference = twin(arch, dims)
    start = weights_of(reference)
    base = actor_for(reference, arch)
    base_metrics, base_forwards = counting_forwards(update, base)
    base_grads = gather_hf_tensors(reference, arch, tensor_of=lambda p: p.main_grad)
    out = []
    for fields in settings:
        chunks = twin(arch, dims, start, recompute=RecomputeConfig(**fields))
        actor = actor_for(chunks, arch)
        metrics, forwards = counting_forwards(update, actor)
        grads = gather_hf_tensors(chunks, arch, tensor_of=lambda p: p.main_grad)
        diffs = {name: relative(grads[name], base_grads[name]) for name in base_grads}
        worst = max(diffs, key=diffs.get)
        out.append(dict(recompute=fields, loss=metrics["loss"], loss_off=base_metrics["loss"],
                        loss_diff=abs(metrics["loss"] - base_metrics["loss"]), grad_diff=diffs[worst],
                        worst_grad=worst, grads=len(diffs), forwards=forwards, forwards_off=base_forwards,
                        granularity=chunks[0].config.recompute_granularity))
    return out


def describe_optimizer(state) -> dict:
    """What Megatron built: the inner optimizers' classes, and for its offload the share of each
    rank's optimizer elements stepped on the host and where those moments are."""
    inner = [o.optimizer for o in getattr(state.optimizer, "chained_optimizers", [state.optimizer])]
    host = total = 0
    devices = set()
    for opt in inner:
        if hasattr(opt, "gpu_params_map_cpu_copy"):  # HybridDeviceOptimizer
            params = [p for g in opt.param_groups for p in g["params"]]
            total += sum(p.numel() for p in params)
            host += sum(p.numel() for p in opt.gpu_params_map_cpu_copy)
            devices |= {str(v.device) for o in opt.cpu_optimizers for s in o.state.values()
                        for v in s.values() if torch.is_tensor(v) and v.dim()}
    return dict(classes=sorted({type(o).__name__ for o in inner}), host_share=host / total if total else 0.0,
                host_moment_devices=sorted(devices))


def bf16_ulps(a, b):
    """Largest difference of two bf16 tensors in units of bf16's spacing at each element (8
    significant bits) plus 1e-6: two fp32 Adam implementations (torch's fused one on the host, its
    loop on the device) agree to fp32 rounding, which moves a bf16 weight by at most one spacing,
    or flips the sign of one within 1e-6 of zero (an update of lr 1e-2 is 1e4 times that)."""
    a, b = a.double(), b.double()
    return float(((a - b).abs() / (torch.maximum(a.abs(), b.abs()) * 2.0 ** -7 + 1e-6)).max())


def offload_case(arch, dims, fractions):
    # Megatron offloads bf16/fp16 models' optimizers only (OptimizerOffloadConfig's check).
    reference = twin(arch, dims, dtype=torch.bfloat16)
    start = weights_of(reference)
    initial = gather_hf_tensors(reference, arch)
    # lr 1e-2 moves every weight by many bf16 spacings: an update that skips a parameter shows.
    actors = [(None, actor_for(reference, arch, lr=1e-2, distributed=True, eps=1e-3))]
    actors += [(f, actor_for(twin(arch, dims, start, dtype=torch.bfloat16), arch,
                             OptimizerOffloadConfig(fraction=f), lr=1e-2, eps=1e-3)) for f in fractions]
    weights = {}
    for fraction, actor in actors:
        for step in range(2):
            update(actor, seed=step)
        weights[fraction] = gather_hf_tensors(actor.state.chunks, arch)
    moved = min(bf16_ulps(weights[None][n], initial[n]) for n in initial if "norm" not in n)
    out = []
    for fraction, actor in actors[1:]:
        diffs = {name: bf16_ulps(weights[fraction][name], weights[None][name]) for name in weights[None]}
        worst = max(diffs, key=diffs.get)
        out.append(dict(fraction=fraction, weight_ulps=diffs[worst], worst_weight=worst,
                        reference_moved_ulps=moved, optimizer=describe_optimizer(actor.state),
                        reference_optimizer=describe_optimizer(actors[0][1].state)))
    return out


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--recompute", default="[]", help="JSON list of [layout, ParallelDims "
                        "fields, model name, hf_dir, [RecomputeConfig fields, ...]]")
    parser.add_argument("--offload", default="[]", help="JSON list of [layout, ParallelDims fields, "
                        "model name, hf_dir, [fraction, ...]]")
    args = parser.parse_args()
    world = megatron_groups.init_distributed()
    result = {"recompute": [], "offload": [], "seconds": {}}
    for kind, run_case in (("recompute", recompute_case), ("offload", offload_case)):
        for layout, fields, model, hf_dir, variants in json.loads(getattr(args, kind)):
            start = time.perf_counter()
            dims = ParallelDims(world_size=world, **fields)
            megatron_groups.initialize(dims)  # groups rebuilt and RNGs seeded per case
            arch = arch_from_hf_config(load_hf_config(hf_dir))
            for row in run_case(arch, dims, variants):
                result[kind].append(dict(layout=layout, model=model, **row))
            result["seconds"][f"{kind}:{layout}:{model}"] = round(time.perf_counter() - start, 1)
    if megatron_groups.is_rank0():
        print(json.dumps(result), flush=True)
    megatron_groups.destroy()


if __name__ == "__main__":
    main()
