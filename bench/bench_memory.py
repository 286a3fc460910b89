"""Memory of the log-prob + entropy path: megarl's vocab-parallel head against the full-width
log-softmax most trainers run, forward + backward, on [tokens, vocab] logits.

  python bench/bench_memory.py [--quick] [--device cpu|cuda] [--tokens N] [--vocab V] [--kernels K,K]

Cases (one JSON object each on stdout; each case runs in a process of its own, so one case's
freed memory cannot hide another's peak):
  head      megarl.algos.vocab_parallel.logprobs_and_entropy on the model's logits as the output
            layer returns them (--dtype, bf16 by default), what the actor passes it, once per
            kernel of --kernels (default: eager and compiled; the CPU runs eager, a GPU compiled).
            The compiled kernels are built on a small input first, outside the measured window.
  full      the same numbers the way they are usually computed: the logits upcast to fp32 whole,
            log_softmax, gather, entropy = -sum(p log p), autograd through all of it (what megarl's
            actor did before: 6.0x the fp32 logits on an H100). Run only where it fits
            (--full-max-gb), since that is the point.
`peak_over_fp32_logits`: the peak extra memory (GPU: the CUDA allocator's peak; CPU: the resident
set's high-water mark, platform/device_memory.py) over the bytes of the fp32 logits; beside it
`planned_over_fp32_logits`, vocab_parallel.working_bytes for the same kernels (what the memory plan
counts). Target: every head case <= 1.0x at every token count. A line then compares each head
case's log-probs, entropies and gradients with the full-width case's where both ran.
  plan_vs_measured  (--phases-only: this case alone; --no-phases: skip it) the memory plan
            (planning/memory_plan.py, what scripts/plan_memory.py and the preflight use) against
            the measured peak of each phase of a real actor step (old log-probs, update) at three
            layouts of two ranks (bench/memory_phases.py: a 36M-parameter fp32 Qwen3, 64K
            vocabulary, micro-batches filled to 1,024 tokens), each phase's peak above the
            process's memory before the model is built. Bound: within PHASE_BOUND of the
            measured value. One JSON object per layout, then a summary.
"""

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from types import SimpleNamespace

import torch

TARGET = 1.0
PHASE_BOUND = 0.15  # |planned - measured| <= 15% of measured, every phase at every layout
PHASE_LAYOUTS = [["tp2", {"tp": 2}], ["pp2", {"pp": 2}], ["dp2", {}]]
# A model whose training state and logits dwarf what the process holds besides them.
PHASE_MODEL = dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=64000,
                   hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=64, max_position_embeddings=1024, rms_norm_eps=1e-6,
                   tie_word_embeddings=False, rope_theta=1e6, torch_dtype="float32")
PHASE_BATCH = dict(sequences=8, length=256, micro_batch_tokens=1024)


def _logits(args, device):
    g = torch.Generator(device="cpu").manual_seed(0)
    logits = torch.empty(args.tokens, args.vocab, dtype=getattr(torch, args.dtype))
    for block in logits.split(1024):  # no fp32 copy of the whole logits: 16K x 151,936 is 10 GB
        block.copy_(torch.randn(block.shape, generator=g) * 3)
    targets = torch.randint(0, args.vocab, (args.tokens,), generator=g)
    weights = torch.randn(2, args.tokens, generator=g)
    return logits.to(device), targets.to(device), weights.to(device)


def _full_width(logits, targets):
    logp = torch.log_softmax(logits.float(), -1)  # [N, V] fp32, kept for the backward
    return logp.gather(-1, targets[:, None]).squeeze(-1), -(logp.exp() * logp).sum(-1)


@contextlib.contextmanager
def _cuda_window():
    torch.cuda.reset_peak_memory_stats()
    start = torch.cuda.memory_allocated()
    memory = SimpleNamespace(extra_bytes=0)
    yield memory
    memory.extra_bytes = torch.cuda.max_memory_allocated() - start


def _megatron_cross_entropy(device):
    """Megatron-Core's vocab_parallel_cross_entropy at TP1 (what the bare Megatron loss runs), as
    (log-probs, None): its process group of one started here."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    return lambda x, t: (-vocab_parallel_cross_entropy(x[:, None, :], t[:, None])[:, 0], None)


def _head(args, device, kernels):
    from megarl.algos.vocab_parallel import logprobs_and_entropy

    def fn(x, t):
        return logprobs_and_entropy(x, t, None, chunk_tokens=args.chunk_tokens, kernels=kernels)

    start = time.perf_counter()
    if kernels == "compiled":  # compile before measuring: a few tokens of the real vocabulary (Inductor
        # picks a reduction's code by its width; any number of tokens then runs the same kernels)
        small = (torch.randn(64, args.vocab, device=device) * 3).to(getattr(torch, args.dtype))
        small.requires_grad_()
        lp, entropy = fn(small, torch.randint(0, args.vocab, (64,), device=device))
        (lp.sum() + entropy.sum()).backward()
    fn.compile_seconds = round(time.perf_counter() - start, 2) if kernels == "compiled" else None
    return fn


def run_case(args) -> dict:
    from megarl.algos.vocab_parallel import working_bytes
    from megarl.platform import device_memory
    device = torch.device(args.device)
    kernels = args.case if args.case in ("eager", "compiled") else None
    fn = {"full": lambda: _full_width, "megatron": lambda: _megatron_cross_entropy(device)}.get(
        args.case, lambda: _head(args, device, kernels))()
    logits, targets, weights = _logits(args, device)
    logits.requires_grad_()
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def call():
        logprob, entropy = fn(logits, targets)
        loss = (weights[0] * logprob).sum() + (0.0 if entropy is None else (weights[1] * entropy).sum())
        loss.backward()
        return logprob, entropy

    sync()
    start = time.perf_counter()
    # On CUDA the allocator's own peak: device_memory would ask for megarl's GPU path (Transformer
    # Engine), which a bare torch + CUDA machine lacks.
    window = _cuda_window() if device.type == "cuda" else device_memory.measured()
    with window as memory:
        logprob, entropy = call()
        sync()
    seconds = [time.perf_counter() - start]
    for _ in range(args.repeats - 1):  # after the first: allocator and page faults warm
        logits.grad = None
        sync()
        start = time.perf_counter()
        call()
        sync()
        seconds.append(time.perf_counter() - start)
    fp32_bytes = args.tokens * args.vocab * 4
    # the gradient is the caller's (it flows on into the output layer): counted in the peak
    out = {"case": "head" if kernels else args.case, "kernels": kernels, "device": args.device,
           "tokens": args.tokens, "vocab": args.vocab, "dtype": args.dtype,
           "chunk_tokens": args.chunk_tokens if kernels == "eager" else None,
           "seconds": round(statistics.median(seconds[1:] or seconds), 4),
           "first_seconds": round(seconds[0], 4), "peak_extra_gb": memory.extra_bytes / 1e9,
           "fp32_logits_gb": fp32_bytes / 1e9, "peak_over_fp32_logits": memory.extra_bytes / fp32_bytes}
    if kernels is not None:
        out["compile_seconds"] = fn.compile_seconds  # both passes, once per process (Inductor's cache)
        planned = working_bytes(args.tokens, args.vocab, logits.element_size(), backward=True,
                                device="cuda" if kernels == "compiled" else "cpu",
                                chunk_tokens=args.chunk_tokens)
        out["planned_over_fp32_logits"] = planned / fp32_bytes
    if args.save and entropy is not None:
        torch.save({"logprob": logprob.detach().cpu(), "entropy": entropy.detach().cpu(),
                    "grad": logits.grad.cpu()}, args.save)
    return out


def planned_phases(arch, fields: dict, world: int) -> dict:
    """The memory plan's old_logprobs and actor_update peaks (the largest stage's) for the
    worker's run: the CPU path, no engine (the worker builds none), nothing else on the rank."""
    from megarl.models.weights.destination import RolloutLayout
    from megarl.parallel_state.dims import ParallelDims
    from megarl.planning import memory_plan as mp
    request = mp.MemoryRequest(arch=arch, dims=ParallelDims(world_size=world, **fields),
                               rollout=RolloutLayout(1), device_bytes=float("inf"),
                               actor=mp.TrainedModel(PHASE_BATCH["micro_batch_tokens"]), gpu=False,
                               colocated=False)
    stages = mp.plan_memory(request)
    return {phase: max(s.phases[phase] for s in stages) for phase in ("old_logprobs", "actor_update")}


def compare_phases() -> bool:
    """Launch the worker, plan the same runs, print the comparison; True when every phase is
    within PHASE_BOUND."""
    import tempfile

    from megarl.models.hf.config import arch_from_hf_config

    with tempfile.TemporaryDirectory() as hf_dir:
        with open(os.path.join(hf_dir, "config.json"), "w") as f:
            json.dump(PHASE_MODEL, f)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
               os.path.join(os.path.dirname(__file__), "memory_phases.py"), "--hf-dir", hf_dir,
               "--layouts", json.dumps(PHASE_LAYOUTS), "--sequences", str(PHASE_BATCH["sequences"]),
               "--length", str(PHASE_BATCH["length"]),
               "--micro-batch-tokens", str(PHASE_BATCH["micro_batch_tokens"])]
        # glibc hands freed blocks over 64 KB back to the kernel at once, so the resident set follows
        # the tensors alive (its default threshold grows up to 32 MB and then keeps them).
        env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
        out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env).stdout
    measured = json.loads(out.strip().splitlines()[-1])
    arch = arch_from_hf_config(PHASE_MODEL)
    worst = 0.0
    for name, fields in PHASE_LAYOUTS:
        planned = planned_phases(arch, fields, world=2)
        row = {"case": "plan_vs_measured", "layout": name, "phases": {}}
        for phase, value in planned.items():
            error = (value - measured[name][phase]) / measured[name][phase]
            worst = max(worst, abs(error))
            row["phases"][phase] = {"planned_gb": round(value / 1e9, 4),
                                    "measured_gb": round(measured[name][phase] / 1e9, 4),
                                    "error": round(error, 4)}
        print(json.dumps(row), flush=True)
    within = worst <= PHASE_BOUND
    print(json.dumps({"case": "plan_vs_measured_summary", "layouts": len(PHASE_LAYOUTS),
                      "worst_error": round(worst, 4), "bound": PHASE_BOUND, "within_bound": within}))
    return within


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="16,384 tokens x 16,384 (seconds on a CPU)")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--chunk-tokens", type=int, default=None, help="default: the library's")
    parser.add_argument("--full-max-gb", type=float, default=None,
                        help="run the full-width case only while 7x the fp32 logits fit "
                             "(default: 16 on CPU, the GPU's memory on CUDA)")
    parser.add_argument("--phases-only", action="store_true", help="the plan-vs-measured case alone")
    parser.add_argument("--no-phases", action="store_true", help="skip the plan-vs-measured case")
    parser.add_argument("--kernels", default="eager,compiled",
                        help="the head's kernels to measure, comma-separated (vocab_parallel.KERNELS)")
    parser.add_argument("--megatron", action="store_true",
                        help="also Megatron-Core's vocab_parallel_cross_entropy (log-probs only), the "
                             "bare Megatron loss, for its seconds and peak")
    parser.add_argument("--repeats", type=int, default=1,
                        help="timed calls per case; seconds is the median of all but the first")
    parser.add_argument("--case", choices=["eager", "compiled", "full", "megatron"], help=argparse.SUPPRESS)
    parser.add_argument("--save", help=argparse.SUPPRESS)
    args = parser.parse_args()
    unknown = sorted(set(args.kernels.split(",")) - {"eager", "compiled"})
    if unknown:
        parser.error(f"--kernels {args.kernels}: {unknown} unknown; choose from eager,compiled")
    if args.quick:
        args.tokens, args.vocab = 16384, 16384
    if args.chunk_tokens is None:
        from megarl.algos.vocab_parallel import DEFAULT_CHUNK_TOKENS
        args.chunk_tokens = DEFAULT_CHUNK_TOKENS
    if args.case:  # a child: one case
        print(json.dumps(run_case(args)), flush=True)
        return
    if args.phases_only:
        compare_phases()
        return
    torch.set_num_threads(min(torch.get_num_threads(), 2)) if args.device == "cpu" else None
    limit = args.full_max_gb
    if limit is None:
        limit = torch.cuda.get_device_properties(0).total_memory / 1e9 if args.device == "cuda" else 16
    fp32_gb = args.tokens * args.vocab * 4 / 1e9
    saved = {}
    for case in args.kernels.split(",") + ["full"] + (["megatron"] if args.megatron else []):
        if case == "full" and 7 * fp32_gb > limit:
            print(json.dumps({"case": "full", "skipped": f"7 x {fp32_gb:.1f} GB fp32 logits > "
                              f"--full-max-gb {limit:.0f}"}), flush=True)
            continue
        saved[case] = f"/tmp/bench_memory_{os.getpid()}_{case}.pt"
        cmd = [sys.executable, __file__, "--case", case, "--save", saved[case], "--device", args.device,
               "--tokens", str(args.tokens), "--vocab", str(args.vocab), "--dtype", args.dtype,
               "--chunk-tokens", str(args.chunk_tokens), "--repeats", str(args.repeats)]
        line = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1]
        result = json.loads(line)
        if case in ("eager", "compiled"):
            result["target"] = f"<= {TARGET}x the fp32 logits"
            result["meets_target"] = result["peak_over_fp32_logits"] <= TARGET
        print(json.dumps(result), flush=True)
    saved = {case: path for case, path in saved.items() if os.path.exists(path)}  # megatron saves none
    for case in [c for c in saved if c != "full" and "full" in saved]:
        a, b = (torch.load(saved[c], mmap=True) for c in (case, "full"))
        blocks = {key: zip(a[key].split(1024), b[key].split(1024)) for key in a}  # bounded memory
        print(json.dumps({"case": "head_vs_full", "kernels": case, **{
            f"max_abs_diff_{key}": max(float((x.double() - y.double()).abs().max()) for x, y in pairs)
            for key, pairs in blocks.items()}}))
    for path in saved.values():
        os.remove(path)
    if not args.no_phases and args.device == "cpu":
        compare_phases()


if __name__ == "__main__":
    main()
