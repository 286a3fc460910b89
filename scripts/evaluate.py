"""Evaluate a model on a held-out set with vLLM and megarl's scorer, as a run evaluates its eval.sets:

  python scripts/evaluate.py --model PATH --data FILE [--reward SPEC]
                             [--samples 8 --temperature 0.6 --pass-k 1,8]
  python scripts/evaluate.py --model RUN/hf --run-dir RUN --set NAME

--model: an HF checkpoint (a run's exported RUN/hf among them) or a megarl Megatron checkpoint
(RUN/checkpoints/step_NNNNNN, or scripts/convert.py hf-to-megatron's output), converted to HF
first with the project's converter (under torchrun, over its ranks). --run-dir reads the run's
config.json: set NAME's file, keys and reward, the eval.* settings, data.max_prompt_len, the seed
and the producer, so the numbers are the ones the run logs for these weights in metrics.jsonl
(`eval/NAME/...`); flags given override them. Without it the settings are eval.*'s and data.*'s
defaults, and the set's name (its sampling seed and its metrics' names) is the file's stem.

Prints a table per data source (reward_mean, accuracy, pass@k, response_len_mean,
truncation_rate), then one JSON line: {"model", "set", "data", "prompts", "seed", "metrics"}, the
metrics named as metrics.jsonl names them. vLLM's and torch's own output goes to
<run dir or runs>/evaluate/logs/ (--verbose: here).
"""

import argparse
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

from megarl.evaluation.eval_metrics import ALL
from megarl.evaluation.model_source import MEGATRON, ModelSource, model_source, tokenizer_dir
from megarl.models.hf.config import ModelArch, arch_from_hf_config
from megarl.planning.config import RunConfig
from megarl.planning.resolved import resolved_eval
from megarl.planning.typed_config import build

# Config keys as this script's flags name them, for messages about a flag's value.
FLAGS = {"eval.sets key": "--set", "eval.samples": "--samples", "eval.temperature": "--temperature",
         "eval.top_p": "--top-p", "eval.pass_k": "--pass-k", "eval.max_prompts": "--max-prompts",
         "eval.threshold": "--threshold", "eval.max_new_tokens": "--max-new-tokens",
         "data.max_prompt_len": "--max-prompt-len"}
RECORD_KEYS = ("prompt_key", "answer_key", "data_source_key", "extra_info_key")
METRICS = ("reward_mean", "accuracy", "pass@", "response_len_mean", "truncation_rate")


def _pass_k(text: str) -> List[int]:
    try:
        return [int(k) for k in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give the k of pass@k as integers, e.g. 1,8") from None


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="HF checkpoint folder or megarl Megatron checkpoint")
    p.add_argument("--data", help="held-out prompts: .jsonl or .parquet, read as data.* reads (verl's "
                                  "parquet included); with --run-dir: instead of the set's own file")
    p.add_argument("--run-dir", help="a megarl run: its config.json gives the set and every setting")
    p.add_argument("--set", "--set-name", dest="set",
                   help="the set's name: its sampling seed and metric names (default: the data file's "
                        "stem; with --run-dir, the run's only set)")
    p.add_argument("--reward", help="the reward, spelled as algo.reward (default: the run's, else 'math')")
    p.add_argument("--reward-by-source", action="append", default=[], metavar="SOURCE=SPEC",
                   help="a data source's own reward, as algo.reward_by_source (repeatable)")
    for key in RECORD_KEYS:
        p.add_argument(f"--{key.replace('_', '-')}", help=f"the records' key path, as data.{key}")
    p.add_argument("--samples", type=int, help="samples per prompt (eval.samples; default 1)")
    p.add_argument("--temperature", type=float, help="0: greedy (eval.temperature; default 0)")
    p.add_argument("--top-p", type=float, help="eval.top_p (default 1)")
    p.add_argument("--pass-k", type=_pass_k, help="comma-separated k of pass@k, each <= --samples "
                                                  "(eval.pass_k; default 1)")
    p.add_argument("--max-prompts", type=int, help="the file's first N prompts (0: all; eval.max_prompts)")
    p.add_argument("--threshold", type=float, help="a sample is correct when its reward exceeds this "
                                                   "(eval.threshold; default 0.5)")
    p.add_argument("--max-new-tokens", type=int, help="response budget (default: the run's, else 64)")
    p.add_argument("--max-prompt-len", type=int, help="longer prompts are skipped (data.max_prompt_len; "
                                                      "default: the run's, else 256)")
    p.add_argument("--seed", type=int, help="the run's seed (default: the run's, else 0)")
    p.add_argument("--router-fp32", action=argparse.BooleanOptionalAction, default=None,
                   help="MoE router in fp32, as model.router_fp32 (default: the run's, else on)")
    p.add_argument("--tokenizer", help="a folder with the model's tokenizer, where the checkpoint holds "
                                       "none (default: the checkpoint's, else the run's model.hf_dir)")
    p.add_argument("--convert-dir", help="a Megatron checkpoint's HF conversion goes here and is kept "
                                         "(default: a temporary folder, removed at the end)")
    p.add_argument("--verbose", action="store_true", help="print vLLM's and torch's output here")
    return p


@dataclass(frozen=True)
class Plan:
    """What one evaluation runs, decided and checked before any engine starts."""
    config: RunConfig  # eval.sets holds the one set; the rest as the run (or the defaults) had it
    set_name: str
    model: ModelSource
    arch: ModelArch
    tokenizer: str  # folder


def _put(tree: dict, keys: Sequence[str], value) -> None:
    for key in keys[:-1]:
        tree = tree.setdefault(key, {})
    tree[keys[-1]] = value


def _in_flags(message: str) -> str:
    for key, flag in FLAGS.items():
        message = message.replace(key, flag)
    return message


def _run_tree(run_dir: str, name: Optional[str], data: Optional[str]):
    """The run's config.json and the set to evaluate (name; its own entry, or a new one for --data)."""
    path = os.path.join(run_dir, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"--run-dir {run_dir!r} has no config.json (a megarl run writes it as it "
                                "starts): give the run's run_dir, or drop --run-dir and pass --data")
    with open(path) as f:
        tree = json.load(f)
    sets = tree.get("eval", {}).get("sets", {})  # none in a run from before eval.* existed
    if name is None:
        if len(sets) != 1:
            raise ValueError(f"--run-dir {run_dir!r} evaluates {sorted(sets) or 'no sets'}: name one with "
                             "--set NAME" + ("" if sets else ", and its file with --data"))
        (name,) = sets
    if name not in sets and data is None:
        raise ValueError(f"--set {name!r}: run {run_dir!r} evaluates {sorted(sets)}; pick one of them, "
                         "or pass --data FILE for a set of your own")
    _put(tree, ("eval", "sets"), {name: sets.get(name, {})})
    return tree, name


def make_plan(args: argparse.Namespace) -> Plan:
    """The run's config (or the defaults) with the flags applied, built and validated as a run's
    is, and the model and tokenizer to load. Bad input is refused naming the flag and the fix."""
    model = model_source(args.model)
    if args.data is not None and not os.path.isfile(args.data):
        raise FileNotFoundError(f"--data {args.data!r} does not exist (a .jsonl or .parquet file of prompts)")
    if args.run_dir:
        tree, name = _run_tree(args.run_dir, args.set, args.data)
    elif args.data is None:
        raise ValueError("give --data FILE (held-out prompts, .jsonl or .parquet), or --run-dir RUN to "
                         "evaluate a run's held-out set")
    else:
        name = args.set or os.path.splitext(os.path.basename(args.data))[0]
        # A RunConfig needs a model and training data: the evaluated ones stand in (neither is read).
        tree = {"model": {"hf_dir": args.model}, "data": {"path": args.data}, "eval": {"sets": {name: {}}}}
    if model.kind != MEGATRON and args.convert_dir:
        raise ValueError(f"--convert-dir is where a Megatron checkpoint's conversion goes; --model "
                         f"{args.model!r} is an HF checkpoint already: drop --convert-dir")
    if args.convert_dir and os.path.exists(args.convert_dir):
        raise FileExistsError(f"--convert-dir {args.convert_dir!r} already exists; remove it or pick a "
                              "new path")
    one_set = ("eval", "sets", name)
    if args.data is not None:
        _put(tree, (*one_set, "path"), args.data)
    for key in RECORD_KEYS:
        if getattr(args, key) is not None:
            _put(tree, (*one_set, key), getattr(args, key))
    if args.reward is not None:
        _put(tree, (*one_set, "reward"), args.reward)
    for item in args.reward_by_source:
        source, eq, spec = item.partition("=")
        if not eq:
            raise ValueError(f"--reward-by-source {item!r}: spell it SOURCE=SPEC, e.g. openai/gsm8k=math")
        _put(tree, (*one_set, "reward_by_source", source), spec)
    given = {("eval", "samples"): args.samples, ("eval", "temperature"): args.temperature,
             ("eval", "top_p"): args.top_p, ("eval", "pass_k"): args.pass_k,
             ("eval", "max_prompts"): args.max_prompts, ("eval", "threshold"): args.threshold,
             # the engine here is sized for the budget: the run's generation budget no longer bounds it
             ("eval", "max_new_tokens"): args.max_new_tokens,
             ("generation", "max_new_tokens"): args.max_new_tokens,
             ("data", "max_prompt_len"): args.max_prompt_len, ("seed",): args.seed,
             ("model", "router_fp32"): args.router_fp32}
    for keys, value in given.items():
        if value is not None:
            _put(tree, keys, value)
    try:
        config = build(RunConfig, tree)
    except ValueError as error:
        raise ValueError(_in_flags(str(error))) from error
    table = config.eval.sets[name].reward_table(config.algo.reward_table)
    if table.models:
        raise ValueError(f"the reward names reward models {table.models}: scripts/evaluate.py scores "
                         "reward functions and judges only; evaluate with a run (eval.sets), or pass a "
                         "--reward without rm: terms")
    table.check()
    path = config.eval.sets[name].path
    if not os.path.isfile(path):
        raise FileNotFoundError(f"set {name!r}: its file {path!r} (from --run-dir's config.json) does not "
                                "exist; pass the file with --data")
    arch = arch_from_hf_config(model.hf_config())
    longest = config.data.max_prompt_len + resolved_eval(config).max_new_tokens
    if longest > arch.max_position_embeddings:
        raise ValueError(f"--max-prompt-len {config.data.max_prompt_len} + --max-new-tokens "
                         f"{resolved_eval(config).max_new_tokens} = {longest} tokens exceed the model's "
                         f"max_position_embeddings {arch.max_position_embeddings}; lower one of them")
    fallbacks = [args.tokenizer, config.model.hf_dir if args.run_dir else None]
    return Plan(config, name, model, arch, tokenizer_dir(model, fallbacks))


def _converted(source: ModelSource, convert_dir: Optional[str]) -> Tuple[str, Optional[str]]:
    """The HF folder of a Megatron checkpoint, converted here (collective), and the temporary
    folder holding it (None: kept)."""
    import torch.distributed as dist

    from megarl.models.weights.convert import megatron_to_hf

    temporary = None
    if convert_dir is None:
        box = [tempfile.mkdtemp(prefix="megarl_evaluate_") if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(box, src=0)  # one folder for all ranks (one node)
        temporary = box[0]
        convert_dir = os.path.join(temporary, "hf")
    megatron_to_hf(source.path, convert_dir)
    return convert_dir, temporary


def evaluate_plan(plan: Plan, convert_dir: Optional[str] = None) -> dict:
    """The set's metrics (eval/<set>/<source>/<metric>) and its prompt count. Collective."""
    import transformers

    from megarl.evaluation.evaluator import evaluate
    from megarl.evaluation.sets import load_sets
    from megarl.parallel_state import megatron_groups
    from megarl.rewards.scorer import Scorer
    from megarl.rollout.producer import load_producer
    from megarl.rollout.turns import TurnDriver
    from megarl.rollout.vllm.engine import VLLMEngine

    config, name = plan.config, plan.set_name
    evaluation, data, gen, algo = resolved_eval(config), config.data, config.generation, config.algo
    tokenizer = transformers.AutoTokenizer.from_pretrained(plan.tokenizer)
    prompts = load_sets(evaluation, tokenizer, data.max_prompt_len, data.overlong_prompts)
    megatron_groups.init_distributed(config.collective_timeout_s)
    hf_dir, temporary = plan.model.path, None
    engine = scorer = producer = None
    try:
        if plan.model.kind == MEGATRON:
            hf_dir, temporary = _converted(plan.model, convert_dir)
        # As a run's engine is made, but reading the checkpoint's weights instead of a sync's.
        engine = VLLMEngine(hf_dir, seed=config.seed, dtype=plan.arch.dtype,
                            kv_cache_gib=gen.kv_cache_gib, gpu_memory_utilization=gen.gpu_memory_utilization,
                            max_model_len=data.max_prompt_len + evaluation.max_new_tokens,
                            load_format="auto", router_fp32=config.model.router_fp32)
        scorer = Scorer(config.eval.sets[name].reward_table(algo.reward_table), algo.reward_workers,
                        algo.reward_timeout_s)
        producer = load_producer(gen.producer, tokenizer, gen.agent)
        metrics = evaluate(TurnDriver(engine), producer, prompts, evaluation, tokenizer, {name: scorer},
                           config.seed)
    finally:
        closers = (engine and engine.shutdown, scorer and scorer.close, producer and producer.close)
        for close in filter(None, closers):
            close()
        megatron_groups.destroy()
        if temporary:
            shutil.rmtree(temporary, ignore_errors=True)
    return {"prompts": len(prompts[name]), "metrics": metrics}


def table(metrics: Dict[str, float], set_name: str) -> str:
    """The set's metrics as rows per data source (the whole set, `all`, last)."""
    prefix = f"eval/{set_name}/"
    rows: Dict[str, Dict[str, float]] = {}
    for key, value in metrics.items():
        source, metric = key[len(prefix):].split("/", 1)
        rows.setdefault(source, {})[metric] = value
    columns = sorted(rows[ALL], key=lambda m: (next(i for i, p in enumerate(METRICS) if m.startswith(p)),
                                               int(m[5:]) if m.startswith("pass@") else 0))
    order = sorted(s for s in rows if s != ALL) + [ALL]
    width = max(len(s) for s in order + ["source"])
    lines = [f"{'source':<{width}}  " + "  ".join(f"{c:>{max(len(c), 8)}}" for c in columns)]
    for source in order:
        lines.append(f"{source:<{width}}  " + "  ".join(f"{rows[source][c]:>{max(len(c), 8)}.4f}"
                                                         for c in columns))
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> None:
    p = parser()
    args = p.parse_args(argv)
    try:
        plan = make_plan(args)
    except (ValueError, FileNotFoundError, FileExistsError) as error:
        p.error(str(error))
    from megarl.trainer import console

    rank = int(os.environ.get("RANK", "0"))
    logs = os.path.join(args.run_dir or "runs", "evaluate")
    with console.output(logs, f"rank{rank}", args.verbose, tell=rank == 0):
        result = evaluate_plan(plan, args.convert_dir)
        if rank == 0:
            evaluation = resolved_eval(plan.config)
            console.say(f"megarl: set {plan.set_name}: {result['prompts']} prompts x {evaluation.samples} "
                        f"samples, temperature {evaluation.temperature}, seed {plan.config.seed}")
            console.say(table(result["metrics"], plan.set_name))
            console.say(json.dumps({"model": args.model, "set": plan.set_name,
                                    "data": plan.config.eval.sets[plan.set_name].path,
                                    "prompts": result["prompts"], "seed": plan.config.seed,
                                    "metrics": result["metrics"]}))


if __name__ == "__main__":  # dist_checkpointing's writer processes re-import __main__
    main()
