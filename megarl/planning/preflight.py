"""Checks of a whole run before any process starts, and the run they pass: the layout against
the model, the rollout engines against the world and the model, sequence lengths and batch plans
against the layout, the memory plan, and the prompt data (the held-out sets' too).

Each section of RunConfig validates itself when loaded; what needs two sections or the model's
config.json is checked here, on the resolved run (planning/resolved.py) that preflight returns, so a
run that cannot work is refused (naming the values and the fix) before Ray places a worker or a
GPU is touched, and the run that can is the one every rank then takes. Does not own the checks'
definitions: ParallelDims, transformer_config, check_rollout and plan_micro_batches are the ones the
run itself applies later.
"""

import os

import torch

from megarl.actor.config import BatchingConfig
from megarl.actor.optimizer import offload_fields
from megarl.actor.packing import plan_micro_batches
from megarl.actor.passes import mini_batch_rows
from megarl.evaluation.sets import load_sets
from megarl.models.hf.config import ModelArch, load_hf_config, reward_model_arch
from megarl.models.megatron.config import check_te_dtype, transformer_config
from megarl.models.weights.destination import RolloutLayout, check_rollout
from megarl.parallel_state.dims import ParallelDims
from megarl.planning import memory_plan
from megarl.planning.config import RunConfig
from megarl.planning.resolved import ResolvedRun, resolve
from megarl.platform import device_choice
from megarl.rollout.agent.loop import load_tools, uses_tools
from megarl.rollout.builder import load_training_prompts
from megarl.rollout.vllm.engine import check_engine_dtype, check_engine_ep, check_engine_experts


def _check_rollout(config: RunConfig, arch: ModelArch) -> None:
    """Shards vLLM can make at the rollout layout (the same divisibility the sync plan uses), in a
    dtype it runs the model in."""
    layout = config.layout
    check_engine_ep(layout.rollout_tp, layout.rollout_ep)
    check_engine_dtype(arch)
    check_engine_experts(arch, layout.rollout_tp)
    check_rollout(arch, RolloutLayout(layout.rollout_tp, layout.rollout_ep),
                  layout.rollout_world_size or layout.world_size)


def _check_batching(batching: BatchingConfig, sequences: int, longest: int, dims: ParallelDims,
                    section: str) -> None:
    """Every pass over a step's sequences can be planned, even when all are the longest."""
    for rows in (sequences, len(mini_batch_rows(sequences, batching)[0])):  # log-probs, update
        try:
            plan_micro_batches([longest] * rows, dims.dp, batching.micro_batch_tokens,
                               batching.micro_batches, min_micro_batches=dims.pp if dims.vpp else 1)
        except ValueError as error:
            raise ValueError(f"{section}.batching with {rows} sequences over dp={dims.dp}: "
                             f"{error}") from error


def _check_data(run: ResolvedRun) -> None:
    """The prompt file (and each held-out set's) reads, every record has its fields and a prompt,
    and the overlong ones are allowed: the same loads every rank does later, done once here so a
    bad file costs no start-up."""
    import transformers

    config = run.config
    data = config.data
    if not os.path.isfile(data.path):
        raise FileNotFoundError(f"data.path={data.path!r} does not exist (a .jsonl or .parquet file "
                                "of prompts)")
    tokenizer = transformers.AutoTokenizer.from_pretrained(config.model.hf_dir)
    prompts = load_training_prompts(data, tokenizer)
    if config.generation.producer == "agent":
        load_tools(config.generation.agent)  # they load, and their code sandbox works here
        for index, prompt in enumerate(prompts.prompts):
            try:
                uses_tools(prompt.extra_info.get("agent_name"))
            except ValueError as error:
                raise ValueError(f"{data.path} prompt {index}: {error}") from None
    load_sets(run.eval, tokenizer, data.max_prompt_len, data.overlong_prompts)
    for table in run.reward_tables:
        table.check()


def preflight(config: RunConfig) -> ResolvedRun:
    """The run `config` resolves to (planning/resolved.py), once it passed every check; raises
    ValueError/FileNotFoundError naming the values if it cannot run."""
    config.logger.check_installed()  # the trackers' packages, before anything is loaded
    # MEGARL_DEVICE and MEGARL_TRANSFORMER_ENGINE against this machine: what is missing, named, first
    use_te = device_choice.uses_transformer_engine()
    run = resolve(config)
    arch, dims = run.arch, run.dims
    transformer_config(arch, dims, use_te=use_te)  # the builder's check_model, then Megatron's
    check_te_dtype(arch.torch_dtype, use_te=use_te)
    _check_training_state(config, arch, dims)
    _check_rollout(config, arch)
    longest = config.data.max_prompt_len + config.generation.max_new_tokens
    if longest > arch.max_position_embeddings:
        raise ValueError(f"data.max_prompt_len + generation.max_new_tokens = {longest} exceeds the "
                         f"model's max_position_embeddings {arch.max_position_embeddings}")
    sequences = config.data.prompts_per_step * config.generation.samples_per_prompt
    _check_batching(config.actor.batching, sequences, longest, dims, "actor")
    if config.algo.uses_critic:
        _check_batching(config.critic.batching, sequences, longest, dims, "critic")
    for path in run.reward_model_dirs:
        _check_reward_model(path, dims, longest)
    if run.teacher_dims is not None:
        _check_teacher(run, longest, use_te)
    _check_memory(run)
    _check_data(run)
    return run


def _check_memory(run: ResolvedRun) -> None:
    """A GPU run's memory plan (planning/memory_plan.py) against layout.gpu_memory_gb, or this
    machine's GPU: refused, naming the phase that does not fit and the knobs left that would make
    it fit. Planned with the attention of the layer spec the run takes and the Adam Megatron builds
    (memory_plan.run_kernels: on a GPU this machine's; planned from elsewhere, the config's
    model.transformer_engine). CPU runs are not planned (nothing to size them against but the
    host's RAM)."""
    gpu_gb = run.config.layout.gpu_memory_gb
    if gpu_gb is None:
        if not device_choice.on_gpu():
            return
        gpu_gb = torch.cuda.get_device_properties(0).total_memory / memory_plan.GB
    rewards = tuple(reward_model_arch(load_hf_config(path), path) for path in run.reward_model_dirs)
    request = memory_plan.request_for_run(run, gpu_gb * memory_plan.GB, gpu=True,
                                          runtime_bytes=memory_plan.RUNTIME_RESERVE_GB * memory_plan.GB,
                                          reward_models=rewards)
    verdict = memory_plan.summary(request, memory_plan.plan_memory(request))
    if not verdict["fits"]:
        raise ValueError(memory_plan.refusal(verdict))


def _check_training_state(config: RunConfig, arch: ModelArch, dims: ParallelDims) -> None:
    """Recompute and optimizer offload of the actor (and the critic when the run has one) on this
    machine, as build_model and TrainState will apply them."""
    on_gpu, use_te = device_choice.on_gpu(), device_choice.uses_transformer_engine()
    sections = {"actor": config.actor} | ({"critic": config.critic} if config.algo.uses_critic else {})
    for section, role in sections.items():
        try:
            transformer_config(arch, dims, use_te=use_te, recompute=role.recompute)
            offload_fields(role.optimizer_offload, arch.torch_dtype, on_gpu, use_te)
        except ValueError as error:
            raise ValueError(f"{section}: {error}") from error
    recompute = config.actor.recompute
    routers_rerun = recompute.granularity == "full" or "moe" in (recompute.modules or ())
    if config.actor.router_replay != "off" and routers_rerun and dims.pp > 1:
        # The replay sets each router's experts before its micro-batch's forward; a pipeline runs
        # later micro-batches' forwards before an earlier one's backward recomputes it.
        raise ValueError(f"actor.router_replay={config.actor.router_replay!r} with actor.recompute."
                         f"granularity={recompute.granularity!r} at pp={dims.pp}: a recomputed "
                         "router would replay another micro-batch's experts; recompute no routers "
                         "(granularity=none, or selective without moe) or set router_replay=off")


def _check_reward_model(path: str, dims: ParallelDims, longest: int) -> None:
    """rm:PATH is a one-label sequence classifier the training layout can hold, reading sequences
    as long as the run's (with the policy's tokens; its own tokenizer's are checked as it reads)."""
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise FileNotFoundError(f"reward rm:{path}: no config.json in {path!r}; rm:PATH names the "
                                "folder of an HF *ForSequenceClassification checkpoint")
    arch = reward_model_arch(load_hf_config(path), path)
    try:
        transformer_config(arch, dims)
    except ValueError as error:
        raise ValueError(f"reward model {path!r} cannot run at the training layout: {error}") from error
    if longest > arch.max_position_embeddings:
        raise ValueError(f"data.max_prompt_len + generation.max_new_tokens = {longest} exceeds reward "
                         f"model {path!r}'s max_position_embeddings {arch.max_position_embeddings}")


def _check_teacher(run: ResolvedRun, longest: int, use_te: bool) -> None:
    """The colocated teacher can be built at its own layout (teacher.tp/pp/ep; its heads, layers
    and experts split over them) in its dtype, and reads sequences as long as the run's."""
    teacher, arch, dims = run.config.teacher, run.teacher_arch, run.teacher_dims
    try:
        transformer_config(arch, dims, use_te=use_te)
        check_te_dtype(arch.torch_dtype, use_te=use_te)
    except ValueError as error:
        raise ValueError(f"teacher {teacher.hf_dir!r} at teacher.tp={teacher.tp}, teacher.pp={teacher.pp}, "
                         f"teacher.ep={teacher.ep}: {error}") from error
    if longest > arch.max_position_embeddings:
        raise ValueError(f"data.max_prompt_len + generation.max_new_tokens = {longest} exceeds teacher "
                         f"{teacher.hf_dir!r}'s max_position_embeddings {arch.max_position_embeddings}")
