"""megarl's rollout generation against bare vLLM: the same prompts, sampling parameters and weights.

  python bench/bench_rollout.py [--quick | --smoke] [--profile]

Builds megarl's VLLMEngine on a tiny random Qwen3 checkpoint whose vocabulary is the demo task's
sentencepiece tokenizer (megarl/demo/arithmetic_task.py), then times, interleaved and
repeated with fixed seeds:
  bare      engine.llm.generate(TokensPrompt..., SamplingParams(..., logprobs=0)), as a vLLM user
            calls it, on the very same LLM object;
  generate  VLLMEngine.generate: the same call plus the log-prob extraction into RolloutSamples;
  collect   megarl.rollout.collect.collect: the completion producer streaming the draw through the
            TurnDriver (every sample its own request, the engine stepped one scheduler step at a
            time, as every run generates), all-gather (a world of one), decode with the tokenizer,
            score with the math verifier, lay out a RolloutBatch.
Every repeat must produce the same token ids on all three paths, and megarl's log-probs must be
vLLM's (asserted). Prints one JSON object per case (generate vs bare, collect vs bare) on stdout;
logs go to stderr. overhead_ratio compares median times of separate calls, which other processes
on a shared machine can move by several percent either way; own_share is megarl's time outside
vLLM's entry points (LLM.generate, and its engine's add_request and step) within the same calls,
which they cannot. --profile prints cProfile's view
of one megarl generate to stderr. Does not time engine start-up or weight sync (bench_sync.py).
"""

import argparse
import cProfile
import io
import json
import os
import pstats
import shutil
import statistics
import sys
import time

from paired_timing import compare, json_stdout  # bench/ is the script's directory

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OVERHEAD_TARGET = 0.05



def make_inputs(out_dir: str, prompts: int, seed: int):
    """The demo task's tokenizer and prompts, and a random Qwen3 with that vocabulary."""
    import transformers

    from megarl.demo.arithmetic_task import arithmetic_records, train_tokenizer
    from megarl.demo.tiny_checkpoint import make_tiny_checkpoint
    from megarl.rollout.prompts import Prompt, RecordKeys, render

    records = arithmetic_records(2000, max_operand=99, seed=seed)
    train_tokenizer(records, out_dir)
    tokenizer = transformers.AutoTokenizer.from_pretrained(out_dir)
    # ~14M parameters: big enough that the model, not Python, sets the pace of a decode step on
    # CPU, small enough that a quick run stays within a couple of minutes.
    make_tiny_checkpoint("qwen3", out_dir, seed=seed, vocab_size=len(tokenizer), hidden_size=512,
                         intermediate_size=1536, num_attention_heads=8, num_key_value_heads=4,
                         max_position_embeddings=1024, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    chosen = []
    for record in records[:prompts]:
        _, text = render(record, tokenizer, RecordKeys(), "bench_rollout's prompts")
        chosen.append(Prompt(text, tokenizer.encode(text, add_special_tokens=False), record["answer"]))
    return tokenizer, chosen


def timed(fn):
    """(wall seconds, CPU seconds of this process, result) of one call."""
    start, start_cpu = time.perf_counter(), time.process_time()
    result = fn()
    return time.perf_counter() - start, time.process_time() - start_cpu, result


def time_inside_vllm(llm) -> list:
    """Wrap this LLM object's entry points (generate, and the engine's add_request and step, which
    streamed requests call) so that each outermost call appends its wall seconds to the list
    returned (generate calls the other two: counted once). A megarl call's own work is its total
    minus what lands there: both are measured in the same call, so other processes slowing the
    machine between calls cannot fake or hide it."""
    inner, depth = [], [0]

    def timed(call):
        def timed_call(*args, **kwargs):
            depth[0] += 1
            start = time.perf_counter()
            try:
                return call(*args, **kwargs)
            finally:
                depth[0] -= 1
                if not depth[0]:
                    inner.append(time.perf_counter() - start)
        return timed_call

    llm.generate = timed(llm.generate)
    engine = llm.llm_engine
    engine.add_request, engine.step = timed(engine.add_request), timed(engine.step)
    return inner


def case_json(path: str, wall: dict, cpu: dict, own: list, tokens: int, extra: dict) -> dict:
    times = compare(wall, cpu, path, "bare")
    overhead = times["ratio"] - 1
    return {"case": f"rollout_{path}_vs_bare", "tokens_generated": tokens, "repeats": len(wall[path]),
            **times, "bare_tokens_per_s": tokens / times["bare_seconds"],
            f"{path}_tokens_per_s": tokens / times[f"{path}_seconds"],
            "own_seconds": statistics.median(own), "own_share": statistics.median(
                o / t for o, t in zip(own, wall[path])),
            "overhead_ratio": overhead,
            "target": f"overhead_ratio <= {OVERHEAD_TARGET}", "target_held": overhead <= OVERHEAD_TARGET,
            **extra}


def profile_generate(generate) -> None:
    """cProfile one megarl generate; print the top entries and the share of its time spent
    outside vLLM's LLM.generate (megarl's own work) to stderr."""
    profiler = cProfile.Profile()
    profiler.runcall(generate)
    stats = pstats.Stats(profiler, stream=io.StringIO())
    cumulative = {(os.path.basename(file), name): entry[3]
                  for (file, _, name), entry in stats.stats.items()}
    total, inner = cumulative[("rollout/vllm/engine.py", "generate")], cumulative[("llm.py", "generate")]
    stats.stream = sys.stderr
    stats.sort_stats("cumulative").print_stats(25)
    print(f"megarl VLLMEngine.generate {total:.3f}s, of which vLLM's LLM.generate {inner:.3f}s: "
          f"megarl's own share {(total - inner) / total:.2%}", file=sys.stderr)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer prompts, tokens and repeats")
    parser.add_argument("--smoke", action="store_true",
                        help="the smallest size, to check the bench runs (tests/test_bench_smoke.py)")
    parser.add_argument("--profile", action="store_true", help="cProfile one megarl generate (stderr)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--inputs", default=os.path.join(ROOT, "runs", "bench_rollout"),
                        help="where the tokenizer and model are made (afresh on every run)")
    args = parser.parse_args()
    out = json_stdout()
    prompts_count, n, max_new, repeats = ((4, 2, 16, 2) if args.smoke else (16, 4, 64, 5) if args.quick
                                          else (64, 8, 128, 5))

    import torch
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from megarl.parallel_state import megatron_groups
    from megarl.rewards.functions import RewardTable
    from megarl.rewards.scorer import Scorer
    from megarl.rollout.collect import collect
    from megarl.rollout.completion import Completion
    from megarl.rollout.engine import SamplingConfig
    from megarl.rollout.turns import TurnDriver
    from megarl.rollout.vllm.engine import VLLMEngine

    shutil.rmtree(args.inputs, ignore_errors=True)
    tokenizer, prompts = make_inputs(args.inputs, prompts_count, args.seed)
    megatron_groups.init_distributed()  # collect() gathers over the world (here of one)
    engine = VLLMEngine(args.inputs, seed=args.seed, kv_cache_gib=2,
                        max_model_len=max(len(p.token_ids) for p in prompts) + max_new)
    sampling = SamplingConfig(n=n, temperature=1.0, max_new_tokens=max_new,
                              stop_token_ids=(tokenizer.eos_token_id,), seed=args.seed)
    token_ids = [p.token_ids for p in prompts]
    scorer = Scorer(RewardTable("math"), workers=0, timeout_s=60)  # in process, as before

    vllm_generate = engine.llm.generate  # the bound method a vLLM user calls
    inside_vllm = time_inside_vllm(engine.llm)  # megarl's calls reach vLLM through the wrapper

    def bare():  # a vLLM user builds the parameters and prompts on every call too
        # seeded per prompt as megarl seeds them (engine.sample_seed), so both sample the same
        params = [SamplingParams(n=n, temperature=1.0, max_tokens=max_new,
                                 stop_token_ids=[tokenizer.eos_token_id], seed=args.seed + p * n, logprobs=0)
                  for p in range(len(token_ids))]
        return vllm_generate([TokensPrompt(prompt_token_ids=p) for p in token_ids], params,
                             use_tqdm=False)

    paths = {
        "bare": bare,
        "generate": lambda: engine.generate(token_ids, sampling),
        "collect": lambda: collect(TurnDriver(engine), Completion(), prompts, sampling, tokenizer, scorer),
    }

    def responses(path: str, result):
        if path == "bare":
            return [list(c.token_ids) for o in result for c in o.outputs]
        if path == "generate":
            return [s.response_ids for s in result]
        batch = result.batch
        return [batch.tokens[row][batch.loss_mask[row].bool()].tolist() for row in range(batch.size)]

    for fn in paths.values():  # warm-up: first-call allocations and compilation
        fn()
    wall, cpu, own = ({path: [] for path in paths} for _ in range(3))
    expected = None
    for repeat in range(repeats):
        # Alternate the order so that neither path always runs first after the other's cache use.
        order = list(paths) if repeat % 2 == 0 else list(reversed(paths))
        for path in order:
            calls = len(inside_vllm)
            elapsed, elapsed_cpu, result = timed(paths[path])
            wall[path].append(elapsed)
            cpu[path].append(elapsed_cpu)
            own[path].append(elapsed - sum(inside_vllm[calls:]))
            got = responses(path, result)
            expected = expected or got
            if got != expected:
                raise AssertionError(f"{path} produced different tokens than the first path on repeat "
                                     f"{repeat}: the comparison is not on equal work")
        print(f"repeat {repeat}: " + ", ".join(f"{p} {wall[p][-1]:.3f}s (cpu {cpu[p][-1]:.3f}s)"
                                               for p in paths), file=sys.stderr)

    samples = paths["generate"]()
    vllm_logprobs = [torch.tensor([step[t].logprob for step, t in zip(c.logprobs, c.token_ids)])
                     for o in bare() for c in o.outputs]
    if not all(torch.equal(s.logprobs, lp) for s, lp in zip(samples, vllm_logprobs)):
        raise AssertionError("megarl's log-probs differ from the ones vLLM returned for the same tokens")
    tokens = sum(len(r) for r in expected)
    shape = {"prompts": len(prompts), "samples_per_prompt": n, "max_new_tokens": max_new,
             "mean_response_tokens": tokens / len(expected), "model": "qwen3 hidden 512, 4 layers",
             "same_tokens": True}
    for path in ("generate", "collect"):
        print(json.dumps(case_json(path, wall, cpu, own[path], tokens, shape)), file=out)

    if args.profile:
        profile_generate(paths["generate"])
    # No megatron_groups.destroy(): the timing closures keep vLLM's LLM alive until exit, and its
    # exit hook destroys the process groups it shares with this world of one.
    engine.shutdown()


if __name__ == "__main__":
    main()
