"""The run as it will be, resolved once: the config with everything derived from it and the
checkpoint's config.json that more than one part of megarl needs.

Owns deriving those values: the model's architecture, the training layout, the actor's LoRA
adapters (actor.lora, or the PEFT folder actor.lora.init names), the rollout engines' settings,
the held-out evaluation with its token budget, and the reward tables. preflight builds it (and
checks the run against it); the trainer's setup, the rollout ranks, the memory plan and the
checkpoints read it, and none of them derives any of its parts again. Reads only config files:
nothing is built, no process group exists.
"""

from dataclasses import dataclass, replace
from typing import Optional, Tuple

from megarl.evaluation.config import EvalConfig
from megarl.models.hf.config import ModelArch, arch_from_hf_config, load_hf_config
from megarl.models.lora import peft_io
from megarl.models.lora.adapters import LoraConfig
from megarl.models.weights.destination import RolloutLayout
from megarl.models.weights.fp8_layout import check_fp8_dtype, check_fp8_layout
from megarl.models.weights.tables import check_export_dtype
from megarl.parallel_state.dims import ParallelDims
from megarl.planning.config import RunConfig
from megarl.rewards.functions import RewardTable
from megarl.rollout.config import EngineSpec
from megarl.rollout.vllm.lora import AdapterSpec
from megarl.teacher.build import check_same_tokenizer, teacher_arch, teacher_dims


@dataclass(frozen=True)
class ResolvedRun:
    config: RunConfig
    hf_config: dict  # the policy checkpoint's config.json (model.hf_dir)
    arch: ModelArch
    dims: ParallelDims  # the training layout, validated
    adapters: Optional[LoraConfig]  # the actor's LoRA adapters (None: full fine-tuning)
    engine: EngineSpec  # what the rollout engines are made of
    eval: EvalConfig  # the held-out sets, with the token budget resolved
    reward_tables: Tuple[RewardTable, ...]  # training's, then each held-out set's (in eval.sets order)
    teacher_arch: Optional[ModelArch] = None  # the colocated distillation teacher's (teacher.hf_dir)
    teacher_dims: Optional[ParallelDims] = None  # its layout in the trainer's world (teacher.tp/pp/ep)

    @property
    def reward_model_dirs(self) -> Tuple[str, ...]:
        """The reward models (rm:PATH) of every reward table: training's and the held-out sets'."""
        return tuple(sorted({path for table in self.reward_tables for path in table.models}))


def resolved_eval(config: RunConfig) -> EvalConfig:
    """The eval section with its token budget resolved (0: generation.max_new_tokens); also what
    scripts/evaluate.py evaluates a run's sets with."""
    return replace(config.eval, max_new_tokens=config.eval.max_new_tokens or config.generation.max_new_tokens)


def engine_spec(config: RunConfig, arch: ModelArch, adapters: Optional[LoraConfig]) -> EngineSpec:
    """The engines' settings from the model, layout and actor sections for the checkpoint's
    `arch`. A LoRA actor's engines take its adapters alone each sync (into vLLM's LoRA slots, or
    merged by the engine: vllm_lora.slots_refusal)."""
    return EngineSpec(config.model.hf_dir, arch.dtype, config.seed, rollout_tp=config.layout.rollout_tp,
                      rollout_ep=config.layout.rollout_ep, return_routing=config.engine_returns_routing,
                      router_fp32=config.model.router_fp32,
                      adapters=AdapterSpec(arch, adapters) if adapters else None,
                      quantization=config.rollout.quantization)


def resolve(config: RunConfig, hf_config: Optional[dict] = None) -> ResolvedRun:
    """`config` resolved against its checkpoint's config.json (`hf_config`: that file's content
    given instead, e.g. a published config planned without its weights) and the PEFT folder's
    with actor.lora.init; raises naming the values where they cannot be."""
    hf_config = load_hf_config(config.model.hf_dir) if hf_config is None else hf_config
    arch = arch_from_hf_config(hf_config)
    if config.engine_returns_routing and not arch.num_experts:
        raise ValueError(f"generation.return_routing / actor.router_replay=rollout need a MoE model; "
                         f"{arch.family} routes nothing: turn them off")
    if config.rollout.quantization == "fp8":  # before any engine starts
        check_fp8_dtype(arch.dtype)
        check_fp8_layout(arch, RolloutLayout(config.layout.rollout_tp, config.layout.rollout_ep))
    if config.checkpoint.export_hf:
        check_export_dtype(arch.family, config.checkpoint.export_dtype, "checkpoint.export_dtype")
    adapters = peft_io.run_config(config.actor.lora, arch)
    if adapters and config.rollout.quantization != "none":
        raise ValueError("rollout.quantization='fp8' with actor.lora: the engines then take the adapters "
                         "alone each sync, into LoRA slots or merged into weights that are FP8 codes, which "
                         "megarl does not do yet; use rollout.quantization 'none' with LoRA")
    training = config.algo.reward_table
    tables = (training, *(spec.reward_table(training) for spec in config.eval.sets.values()))
    dims = config.layout.dims()
    teacher = layout = None
    if config.teacher.hf_dir:
        if not config.teacher.served:  # colocated: its layout, before its checkpoint is read
            layout = teacher_dims(config.teacher, dims.world_size)
        teacher = teacher_arch(config.teacher, arch, config.model.hf_dir)
        check_same_tokenizer(config.teacher.hf_dir, config.model.hf_dir)
    return ResolvedRun(config=config, hf_config=hf_config, arch=arch, dims=dims,
                       adapters=adapters, engine=engine_spec(config, arch, adapters),
                       eval=resolved_eval(config), reward_tables=tables, teacher_arch=teacher,
                       teacher_dims=layout)
