"""Training throughput: megarl's actor update against bare Megatron-Core, and packed micro-batches
against padded ones, on a tiny random Qwen3 (or Qwen3-MoE) whose forward/backward dominates.

  python bench/bench_train.py [--quick] [--family qwen3|qwen3_moe] [--profile]
  torchrun --nproc-per-node 2 bench/bench_train.py --quick --tp 2      # rank 0 prints

Cases (one JSON object each on stdout; logs on stderr; repeats interleaved, medians):
  actor_update_vs_bare  Actor.update(batch) (PPO loss, one mini-batch, one epoch, micro-batches
                        packed under --micro-batch-tokens) against what a user writing directly
                        against Megatron-Core does with the same model, DDP and optimizer:
                        get_forward_backward_func over the same packed micro-batches (megarl's
                        packing, built once beforehand) with the summed masked cross-entropy
                        GPTModel computes from labels, then TrainState.optimizer.step().
                        Target: overhead <= 10%.
  packed_vs_padded      forward+backward (the bare loss above) of the same sequences, lengths
                        spread evenly over [L/4, L]: megarl's thd packs under the token budget against
                        rows right-padded to the batch's longest, micro-batches of
                        budget // L_max rows (the same tokens per micro-batch). Useful
                        (non-padding) tokens/s of each. Target: packed >= 1.5x padded.
  lora_vs_full          Actor.update of the same batch with LoRA adapters of --lora-rank on every
                        linear (a second copy of the model, base frozen) against full fine-tuning:
                        tokens/s of each and the optimizer state each holds after its updates
                        (TrainState.state_bytes). Target: LoRA's state <= 5% of full's.
Does not measure rollouts or weight sync (bench_rollout.py, bench_sync.py).
"""

import argparse
import cProfile
import json
import os
import pstats
import sys
import time
from functools import partial

import torch
import torch.distributed as dist
from paired_timing import compare, json_stdout  # bench/ is the script's directory

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
UPDATE_OVERHEAD_TARGET = 0.10
PACKING_SPEEDUP_TARGET = 1.5
LORA_STATE_TARGET = 0.05



def make_model(args, dims):
    """A random HF checkpoint (written by rank 0), loaded into this rank's Megatron shards."""
    from megarl.demo.tiny_checkpoint import make_tiny_checkpoint
    from megarl.models.hf.config import arch_from_hf_config
    from megarl.models.hf.weights_io import load_hf_weights
    from megarl.models.megatron.builder import build_model

    hidden = args.hidden
    sizes = dict(vocab_size=args.vocab, hidden_size=hidden, num_hidden_layers=args.layers,
                 num_attention_heads=hidden // 64, num_key_value_heads=max(hidden // 128, 1),
                 max_position_embeddings=args.seq_len)
    # Dense: Qwen3's MLP is ~3x hidden. MoE: 8 experts, top-2 of hidden/2 each: the same active
    # MLP width per token.
    if args.family == "qwen3":
        sizes.update(intermediate_size=3 * hidden)
    else:
        sizes.update(moe_intermediate_size=hidden // 2)
    model_dir = os.path.join(args.inputs, args.family)
    if dist.get_rank() == 0:
        make_tiny_checkpoint(args.family, model_dir, seed=args.seed, dtype=args.dtype, **sizes)
    dist.barrier()
    with open(os.path.join(model_dir, "config.json")) as f:
        arch = arch_from_hf_config(json.load(f))
    chunks = build_model(arch, dims, perform_initialization=False)
    load_hf_weights(chunks, arch, model_dir)
    return chunks, arch


def varied_batch(vocab_size: int, sequences: int, max_len: int, prompt_len: int, seed: int):
    """A RolloutBatch [N, L] whose lengths are spread evenly over [L/4, L] in a shuffled order
    (the uniform distribution without sampling noise: mean 5L/8, longest L), the same on every
    rank; loss on the tokens after the first `prompt_len`, random advantages."""
    from megarl.batch.rollout_batch import RolloutBatch

    g = torch.Generator().manual_seed(seed)
    spread = torch.linspace(max_len / 4, max_len, sequences).round().long()
    lengths = spread[torch.randperm(sequences, generator=g)]
    cols = torch.arange(max_len)[None, :]
    tokens = torch.where(cols < lengths[:, None],
                         torch.randint(0, vocab_size, (sequences, max_len), generator=g), 0)
    mask = ((cols >= prompt_len) & (cols < lengths[:, None])).float()
    return RolloutBatch(tokens=tokens, lengths=lengths, loss_mask=mask,
                        group_ids=torch.arange(sequences),
                        advantages=torch.randn(sequences, max_len, generator=g) * mask)


def packed_inputs(batch, micro_batches, device):
    """Bare-Megatron inputs of megarl's packs: labels are the packs' targets; the loss mask of
    pack position start + i is the row's mask of token i + 1 (the token it predicts)."""
    from megarl.actor.schedule import packed_seq_params

    inputs = []
    for mb in micro_batches:
        mask = torch.zeros(mb.tokens.shape)  # [1, t]
        for row, start, n in zip(mb.rows.tolist(), mb.cu_seqlens_padded[:-1].tolist(), mb.lengths.tolist()):
            mask[0, start:start + n - 1] = batch.loss_mask[row, 1:n]
        inputs.append(dict(tokens=mb.tokens.to(device), labels=mb.targets.to(device),
                           mask=mask.to(device), packed=packed_seq_params(mb, device)))
    return inputs


def padded_inputs(batch, rows, per_micro_batch: int, device):
    """The same sequences as [b, L] micro-batches of `per_micro_batch` rows, right-padded to the
    batch's width; the causal mask alone keeps padding from reaching real tokens."""
    inputs = []
    for part in rows.split(per_micro_batch):
        tokens = batch.tokens[part]  # [b, L]
        labels = torch.roll(tokens, -1, dims=1)
        mask = torch.roll(batch.loss_mask[part], -1, dims=1)  # position i predicts token i + 1
        mask[:, -1] = 0.0
        inputs.append(dict(tokens=tokens.to(device), labels=labels.to(device), mask=mask.to(device),
                           packed=None))
    return inputs


def masked_sum(mask, per_token_loss):  # [b, s] cross-entropy from GPTModel given labels
    loss = (per_token_loss * mask).sum()
    return loss, mask.sum().to(torch.int), {"lm loss": loss.detach()}


def forward_backward(state, inputs, forward_only: bool = False):
    """What a Megatron-Core user writes: one forward_backward_func pass over `inputs`."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    def forward_step(data_iterator, model):
        data = next(data_iterator)
        output = model(data["tokens"], None, None, labels=data["labels"],
                       packed_seq_params=data["packed"])
        return output, partial(masked_sum, data["mask"])

    return get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=iter(inputs), model=state.model[0],
        num_microbatches=len(inputs), seq_length=max(d["tokens"].shape[1] for d in inputs),
        micro_batch_size=inputs[0]["tokens"].shape[0], forward_only=forward_only)


def zero_grads(state):
    state.train_mode(True)
    for chunk in state.model:
        chunk.zero_grad_buffer()
    state.optimizer.zero_grad()


def interleaved(paths: dict, repeats: int):
    """Wall and CPU seconds of each path per repeat; the order alternates so neither path always
    goes first. A barrier before each timed call lines the ranks up (the calls are collective)."""
    for fn in paths.values():  # warm-up: allocator, first-call set-up
        fn()
    wall, cpu = {name: [] for name in paths}, {name: [] for name in paths}
    for repeat in range(repeats):
        for name in list(paths) if repeat % 2 == 0 else list(reversed(paths)):
            dist.barrier()
            start, start_cpu = time.perf_counter(), time.process_time()
            paths[name]()
            wall[name].append(time.perf_counter() - start)
            cpu[name].append(time.process_time() - start_cpu)
        if dist.get_rank() == 0:
            print(f"repeat {repeat}: " + ", ".join(f"{n} {wall[n][-1]:.3f}s (cpu {cpu[n][-1]:.3f}s)"
                                                   for n in paths), file=sys.stderr)
    return wall, cpu



def profile(name: str, fn) -> None:
    """cProfile one call of `fn` (collective: every rank calls it): rank 0 prints the top entries
    by own time, then megarl's functions by cumulative time (what megarl adds), to stderr."""
    profiler = cProfile.Profile()
    profiler.runcall(fn)
    if dist.get_rank() != 0:
        return
    print(f"--- cProfile of one {name} ---", file=sys.stderr)
    stats = pstats.Stats(profiler, stream=sys.stderr)
    stats.sort_stats("tottime").print_stats(15)
    stats.sort_stats("cumulative").print_stats("megarl/", 20)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smaller batch and model, fewer repeats")
    parser.add_argument("--family", default="qwen3", choices=("qwen3", "qwen3_moe"))
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--ep", type=int, default=1)
    parser.add_argument("--hidden", type=int, help="default 512 (--quick) or 768")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--seq-len", type=int, help="longest sequence L; default 256 (--quick) or 512")
    parser.add_argument("--sequences", type=int, help="sequences per update; default 16")
    parser.add_argument("--micro-batch-tokens", type=int, help="packing budget; default 2 L")
    parser.add_argument("--repeats", type=int, help="timed repeats per path; default 5 (--quick) or 4")
    parser.add_argument("--profile", action="store_true", help="cProfile one update of each kind (stderr)")
    parser.add_argument("--threads", type=int, default=1,
                        help="intra-op threads per rank (default 1: on a shared machine, ops split over "
                             "threads wait for the slowest one, and other processes make that slowest "
                             "one arbitrarily late; one thread keeps the repeats within a few percent)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lora-rank", type=int, default=16,
                        help="the adapters' rank in lora_vs_full (0: leave that case out)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                        help="the model's (its checkpoint's) dtype")
    parser.add_argument("--inputs", default=os.path.join(ROOT, "runs", "bench_train"))
    args = parser.parse_args()
    quick = args.quick
    args.hidden = args.hidden or (512 if quick else 768)
    args.seq_len = args.seq_len or (256 if quick else 512)
    args.sequences = args.sequences or 16
    args.repeats = args.repeats or (5 if quick else 4)
    budget = args.micro_batch_tokens or 2 * args.seq_len
    out = json_stdout()
    torch.set_num_threads(args.threads)


    from megarl.actor.actor import Actor
    from megarl.actor.config import ActorConfig, BatchingConfig
    from megarl.actor.optimizer import OptimConfig
    from megarl.actor.passes import local_micro_batches
    from megarl.parallel_state import megatron_groups
    from megarl.parallel_state.dims import ParallelDims

    dims = ParallelDims(world_size=megatron_groups.init_distributed(), tp=args.tp, ep=args.ep)
    if args.sequences % dims.dp:
        # Expert-parallel all-to-alls pair the ranks' micro-batches: equal rows per rank.
        sys.exit(f"--sequences {args.sequences} must be divisible by the data-parallel size {dims.dp}")
    megatron_groups.initialize(dims, seed=args.seed)
    chunks, arch = make_model(args, dims)
    batching = BatchingConfig(micro_batch_tokens=budget)
    actor = Actor(chunks, arch, ActorConfig(policy_loss="ppo", batching=batching,
                                            optim=OptimConfig(lr=1e-6)))
    state = actor.state
    batch = varied_batch(arch.vocab_size, args.sequences, args.seq_len, prompt_len=16, seed=args.seed)
    batch = actor.logprobs(batch)  # old log-probs, as in the loop: the PPO ratio starts at 1
    all_rows = torch.arange(batch.size)
    micro_batches = local_micro_batches(batch, all_rows, batching)
    device = next(chunks[0].parameters()).device
    packed = packed_inputs(batch, micro_batches, device)
    rank0 = dist.get_rank() == 0
    layout = {"family": args.family, "dtype": args.dtype, "hidden": args.hidden, "layers": args.layers,
              "vocab": args.vocab, "layout": dims.describe(), "threads": args.threads,
              "sequences": batch.size, "max_len": args.seq_len, "micro_batch_tokens": budget}
    useful_tokens = int(batch.lengths.sum())

    def bare_update():
        zero_grads(state)
        forward_backward(state, packed)
        state.optimizer.step()

    times = compare(*interleaved({"bare": bare_update, "megarl": lambda: actor.update(batch)},
                                 args.repeats), "megarl", "bare")
    overhead = times["ratio"] - 1
    if rank0:
        print(json.dumps({
            "case": "actor_update_vs_bare", **layout, "micro_batches_per_rank": len(micro_batches),
            "tokens": useful_tokens, "repeats": args.repeats, **times, "overhead_ratio": overhead,
            "target": f"overhead_ratio <= {UPDATE_OVERHEAD_TARGET}",
            "target_held": overhead <= UPDATE_OVERHEAD_TARGET}), file=out)
    if args.profile:
        profile("bare update", bare_update)
        profile("megarl update", lambda: actor.update(batch))

    # This DP rank's rows, padded: a data-parallel trainer splits rows, then pads each to L_max.
    dp, dp_rank = megatron_groups.data().size, megatron_groups.data().rank
    rows_per_mb = max(budget // batch.width, 1)
    padded = padded_inputs(batch, all_rows[dp_rank::dp], rows_per_mb, device)

    def run(inputs):
        zero_grads(state)
        forward_backward(state, inputs)

    times = compare(*interleaved({"packed": partial(run, packed), "padded": partial(run, padded)},
                                 args.repeats), "padded", "packed")
    if rank0:
        print(json.dumps({
            "case": "packed_vs_padded", **layout, "useful_tokens": useful_tokens,
            "padded_tokens": batch.size * batch.width, "repeats": args.repeats,
            "packed_micro_batches_per_rank": len(packed), "padded_micro_batches_per_rank": len(padded),
            "padded_rows_per_micro_batch": rows_per_mb, **times,
            "packed_tokens_per_s": useful_tokens / times["packed_seconds"],
            "padded_tokens_per_s": useful_tokens / times["padded_seconds"],
            "speedup": times["ratio"], "target": f"speedup >= {PACKING_SPEEDUP_TARGET}",
            "target_held": times["ratio"] >= PACKING_SPEEDUP_TARGET}), file=out)
    if args.lora_rank:
        lora_vs_full(args, dims, actor, batch, layout, useful_tokens, out)
    megatron_groups.destroy()


def lora_vs_full(args, dims, actor, batch, layout: dict, useful_tokens: int, out) -> None:
    from megarl.actor.actor import Actor
    from megarl.models.lora import adapters as lora
    from megarl.platform import device_choice
    if device_choice.uses_transformer_engine():  # lora.attach refuses TE's fused norm-linears
        if dist.get_rank() == 0:
            print(json.dumps({"case": "lora_vs_full", **layout, "skipped": "LoRA runs on the portable "
                              "spec: model.transformer_engine=false (docs/lora.md)"}), file=out)
        return
    chunks, arch = make_model(args, dims)
    config = lora.LoraConfig(rank=args.lora_rank)
    lora.attach(chunks, arch, config)
    adapted = Actor(chunks, arch, actor.config)
    times = compare(*interleaved({"full": lambda: actor.update(batch), "lora": lambda: adapted.update(batch)},
                                 args.repeats), "full", "lora")
    full_bytes, lora_bytes = actor.state.state_bytes(), adapted.state.state_bytes()
    if dist.get_rank() == 0:
        print(json.dumps({
            "case": "lora_vs_full", **layout, "lora_rank": config.rank, "tokens": useful_tokens,
            "repeats": args.repeats, **times, "full_tokens_per_s": useful_tokens / times["full_seconds"],
            "lora_tokens_per_s": useful_tokens / times["lora_seconds"],
            "full_optimizer_state_bytes": full_bytes, "lora_optimizer_state_bytes": lora_bytes,
            "state_ratio": lora_bytes / full_bytes, "target": f"state_ratio <= {LORA_STATE_TARGET}",
            "target_held": lora_bytes / full_bytes <= LORA_STATE_TARGET}), file=out)


if __name__ == "__main__":
    main()
