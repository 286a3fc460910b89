"""The configuration of a training run: every section a frozen dataclass, loaded with
megarl.planning.typed_config from YAML plus dotted overrides and validated before any process starts.
Sections that code below the trainer reads live beside it and are composed here: data, generation
and async (megarl/rollout/config.py), actor, critic, eval (their packages' config.py).
Does not own what runs (megarl/trainer/loop.py)."""

from dataclasses import dataclass, field, fields, replace
from typing import Dict, Optional, Tuple, Union

from megarl.actor.config import ActorConfig
from megarl.algos import pick
from megarl.algos.advantages import ADVANTAGE_ESTIMATORS, LONE_GROUPS, WHITENED_BY_DEFAULT
from megarl.algos.kl import KL_ESTIMATORS
from megarl.critic.config import CriticConfig
from megarl.evaluation.config import EvalConfig
from megarl.parallel_state.dims import ParallelDims
from megarl.platform import device_choice
from megarl.rewards.functions import RewardTable
from megarl.rollout.config import AsyncConfig, DataConfig, GenerationConfig, RolloutConfig
from megarl.teacher.config import DistillConfig, TeacherConfig


@dataclass(frozen=True)
class ModelConfig:
    hf_dir: str = ""  # HF checkpoint: architecture, tokenizer, initial weights of actor and critic
    megatron_dir: Optional[str] = None  # optional dist checkpoint of the actor (faster to load)
    router_fp32: bool = True  # a MoE router's logits and top-k in fp32 (False: the model's dtype)
    # DeepSeek-style routers (GLM-4.5, DeepSeek-V3): how far each optimizer step moves the
    # aux-loss-free expert bias toward even loads (Megatron's update; 0 freezes the bias).
    expert_bias_update_rate: float = 1e-3
    # auto: Transformer Engine's layer spec and kernels on a GPU when it imports; true: required;
    # false: Megatron's portable layer spec on CUDA too (said in the run's first lines).
    transformer_engine: Union[bool, str] = "auto"

    def __post_init__(self):
        if not self.hf_dir:
            raise ValueError("model.hf_dir is required (an HF checkpoint folder)")
        device_choice.te_setting(self.transformer_engine, device_choice.TE_KEY)
        if self.expert_bias_update_rate < 0:
            raise ValueError(f"model.expert_bias_update_rate={self.expert_bias_update_rate} must be "
                             ">= 0 (0 keeps the checkpoint's expert bias)")

    def transformer_overrides(self) -> dict:
        """TransformerConfig fields this section changes from megarl's defaults."""
        overrides = {"moe_router_bias_update_rate": self.expert_bias_update_rate}
        if not self.router_fp32:
            overrides["moe_router_dtype"] = None
        return overrides


@dataclass(frozen=True)
class LayoutConfig:
    world_size: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    etp: Optional[int] = None
    vpp: Optional[int] = None
    # Uneven pipelines: the first / last stage's layers when num_layers has no even split
    # (DeepSeek-V3's 61 layers); the other stages share the rest evenly.
    first_stage_layers: Optional[int] = None
    last_stage_layers: Optional[int] = None
    rollout_tp: int = 1
    rollout_ep: int = 1   # 1, or rollout_tp: each engine splits its experts over its ranks
    # 0: the engines run on the training ranks (the hybrid engine). N: on N ranks of their own
    # (launch world_size + N processes; the first world_size train), N / rollout_tp engines of
    # rollout_tp ranks each, weights pushed over a trainer-rollout bridge.
    rollout_world_size: int = 0
    # the weight sync's bucket (opened engine modules per rank; its round buffers are bounded
    # alike): larger buckets let PP stages send at once (docs/PERFORMANCE.md, cluster scale)
    sync_bucket_mb: int = 256
    # GB of each GPU the preflight's memory plan checks the run against (planning/memory_plan.py);
    # None: this machine's GPU (a driver without one, e.g. a Ray head node, then plans nothing)
    gpu_memory_gb: Optional[float] = None

    def __post_init__(self):
        if self.gpu_memory_gb is not None and self.gpu_memory_gb <= 0:
            raise ValueError(f"layout.gpu_memory_gb={self.gpu_memory_gb} must be > 0 (GB per GPU, e.g. "
                             "80 for an H100)")
        if self.sync_bucket_mb < 1:
            raise ValueError(f"layout.sync_bucket_mb={self.sync_bucket_mb} must be >= 1 (MiB per rank; "
                             "256 is the default)")
        if self.rollout_world_size < 0 or self.rollout_world_size % self.rollout_tp:
            raise ValueError(f"layout.rollout_world_size={self.rollout_world_size}: rollout ranks of their "
                             f"own run engines of layout.rollout_tp={self.rollout_tp} ranks each, so give a "
                             f"multiple of {self.rollout_tp} (k engines: k x rollout_tp), or 0 to colocate")

    @property
    def disaggregated(self) -> bool:
        return self.rollout_world_size > 0

    def dims(self) -> ParallelDims:
        """The training layout, validated (raises naming the degrees that do not fit)."""
        return ParallelDims(world_size=self.world_size, tp=self.tp, pp=self.pp, cp=self.cp, ep=self.ep,
                            etp=self.etp, vpp=self.vpp, first_stage_layers=self.first_stage_layers,
                            last_stage_layers=self.last_stage_layers)


@dataclass(frozen=True)
class AlgoConfig:
    advantage: str = "grpo"  # gae uses a critic; the others do not build one
    gamma: float = 1.0
    lam: float = 1.0
    eps: float = 1e-6  # added to standard deviations (GRPO's group std, whitening)
    # Whiten the advantages over the batch's response tokens; None: the estimator's default
    # (algos.advantages.WHITENED_BY_DEFAULT: gae and the reinforce_plus_plus pair yes, others no).
    whiten_advantages: Optional[bool] = None
    lone_groups: str = "zero"  # a prompt with one sample: advantage 0 ("zero") or its reward ("reward", verl)
    # KL to the reference subtracted from the token rewards; outcome estimators score each
    # sequence by its reward minus its summed penalty (algos/advantage_step.py)
    kl_reward_coeff: float = 0.0
    kl_estimator: str = "k1"
    kl_clamp: Optional[float] = None  # limit per-token KL to [-c, c] (verl: 10 for k3); None: no limit
    # The reward (megarl/rewards/spec.py): a weighted sum of terms, e.g. "math + 0.5*rm:PATH".
    # A term is a built-in function (math, exact_match), module:function or file.py:function with
    # megarl's signature fn(response, ground_truth) or verl's compute_score(data_source,
    # solution_str, ground_truth, extra_info); rm:PATH, an HF *ForSequenceClassification reward
    # model run on the training ranks; or judge:CONFIG, a model behind an OpenAI-compatible
    # endpoint (rewards/judge.py). reward_by_source gives a record's data source its own sum.
    reward: str = "math"
    reward_by_source: Dict[str, str] = field(default_factory=dict)
    # Scoring runs once per sample in this many worker processes on rank 0 (0: in the trainer
    # process, one by one, no timeout); a sample running past reward_timeout_s scores 0, counted.
    reward_workers: int = 2
    reward_timeout_s: float = 60.0
    overlong_buffer: int = 0  # DAPO overlong shaping (0: off)
    overlong_penalty: float = 1.0
    # DAPO dynamic sampling: drop groups whose rewards are all equal and refill the batch with
    # up to this many extra generation rounds (0: off).
    dynamic_sampling_rounds: int = 0
    # On-policy distillation's per-token reverse-KL term, from the teacher: section (algos/distill.py)
    distill: DistillConfig = field(default_factory=DistillConfig)

    def __post_init__(self):
        pick(ADVANTAGE_ESTIMATORS, self.advantage, "algo.advantage")
        pick(KL_ESTIMATORS, self.kl_estimator, "algo.kl_estimator")
        if self.lone_groups not in LONE_GROUPS:
            raise ValueError(f"algo.lone_groups={self.lone_groups!r}; choose one of {LONE_GROUPS}")
        if self.kl_clamp is not None and self.kl_clamp <= 0:
            raise ValueError(f"algo.kl_clamp={self.kl_clamp} must be > 0 (or None for no clamp)")
        if not 0 <= self.gamma <= 1 or not 0 <= self.lam <= 1:
            raise ValueError(f"algo.gamma={self.gamma} and algo.lam={self.lam} must lie in [0, 1]")
        if self.dynamic_sampling_rounds < 0:
            raise ValueError(f"algo.dynamic_sampling_rounds={self.dynamic_sampling_rounds} must be >= 0 "
                             "(0 turns dynamic sampling off)")
        if self.reward_workers < 0 or self.reward_timeout_s <= 0:
            raise ValueError(f"algo.reward_workers={self.reward_workers} must be >= 0 and "
                             f"algo.reward_timeout_s={self.reward_timeout_s} > 0")

    @property
    def reward_table(self) -> RewardTable:
        return RewardTable(self.reward, self.reward_by_source)

    @property
    def uses_critic(self) -> bool:
        return self.advantage == "gae"

    @property
    def whitens(self) -> bool:
        if self.whiten_advantages is None:
            return WHITENED_BY_DEFAULT[self.advantage]
        return self.whiten_advantages


@dataclass(frozen=True)
class CheckpointConfig:
    every: int = 0  # save every N steps and after the last one (0: never)
    keep: int = 2  # complete checkpoints kept; older ones are deleted after a save
    export_hf: bool = True  # write the final actor in HF format to run_dir/hf
    # The export's weights: auto (the model's dtype) or fp8 (block FP8, as DeepSeek-V3 and the Qwen3
    # -FP8 releases are published; models/hf/fp8_blocks.py). The family is checked in resolve().
    export_dtype: str = "auto"

    def __post_init__(self):
        if self.every < 0 or self.keep < 1:
            raise ValueError(f"checkpoint.every={self.every} must be >= 0 (0: never) and "
                             f"checkpoint.keep={self.keep} >= 1")
        if self.export_dtype not in ("auto", "fp8"):
            raise ValueError(f"checkpoint.export_dtype={self.export_dtype!r}: expected auto (the "
                             "model's dtype) or fp8 (block FP8)")


# tracker -> (the module it imports, the package and version setup.py pins): what preflight asks
# to import, and the install it names when the import fails.
TRACKER_PACKAGES = {"tensorboard": ("tensorboard", "tensorboard==2.21.0"),
                    "wandb": ("wandb", "wandb==0.31.0"),
                    "mlflow": ("mlflow", "mlflow-skinny==3.17.2")}


@dataclass(frozen=True)
class LoggerConfig:
    """Where each step's metrics go besides run_dir/metrics.jsonl, which is always written
    (trainer/trackers.py; docs/tracking.md)."""
    # Any of tensorboard (run_dir/tensorboard), wandb (offline unless WANDB_MODE says otherwise:
    # run_dir/wandb) and mlflow (run_dir/mlflow.db unless mlflow_uri); [] for metrics.jsonl alone.
    trackers: Tuple[str, ...] = ("tensorboard",)
    project: str = "megarl"  # the W&B project and the MLflow experiment
    name: Optional[str] = None  # the run's name in W&B and MLflow; None: run_dir's folder name
    mlflow_uri: Optional[str] = None  # MLflow's tracking URI; None: sqlite:///<run_dir>/mlflow.db

    def __post_init__(self):
        unknown = [name for name in self.trackers if name not in TRACKER_PACKAGES]
        if unknown or len(set(self.trackers)) != len(self.trackers):
            raise ValueError(f"logger.trackers={list(self.trackers)}: give each of "
                             f"{sorted(TRACKER_PACKAGES)} at most once (or [] for metrics.jsonl alone)")
        if not self.project:
            raise ValueError("logger.project is empty: name the W&B project / MLflow experiment")

    def check_installed(self) -> None:
        """Refuse a chosen tracker whose package does not import here, naming the install."""
        import importlib

        for name in self.trackers:
            module, package = TRACKER_PACKAGES[name]
            try:
                importlib.import_module(module)
            except ImportError as error:
                raise ValueError(f"logger.trackers has {name!r}, but {module!r} does not import here "
                                 f"({error}): install it with `pip install {package}` (make install "
                                 f"does), or take {name!r} out of logger.trackers") from None


@dataclass(frozen=True)
class RunConfig:
    model: ModelConfig
    data: DataConfig
    run_dir: str = "runs/default"
    steps: int = 10
    seed: int = 0
    layout: LayoutConfig = field(default_factory=LayoutConfig)
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)  # the engines' weights
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    async_: AsyncConfig = field(default_factory=AsyncConfig)  # YAML: async (a Python keyword)
    eval: EvalConfig = field(default_factory=EvalConfig)  # held-out sets (megarl/evaluation)
    logger: LoggerConfig = field(default_factory=LoggerConfig)  # metrics' trackers
    teacher: TeacherConfig = field(default_factory=TeacherConfig)  # on-policy distillation (algo.distill)
    # Hybrid-engine handoff: also move the training weights off the device while vLLM generates
    # (optimizer states and gradients always move).
    offload_params: bool = False
    # A collective that not every rank reaches (a dead or stuck rank) fails after this long
    # instead of hanging the job; long enough for the slowest phase (a checkpoint save, a sync).
    collective_timeout_s: float = 1800.0

    def __post_init__(self):
        if self.collective_timeout_s <= 0:
            raise ValueError(f"collective_timeout_s={self.collective_timeout_s} must be > 0 (seconds)")
        if bool(self.algo.distill.coeff) != self.teacher.active:
            raise ValueError(f"algo.distill.coeff={self.algo.distill.coeff} with teacher.hf_dir="
                             f"{self.teacher.hf_dir!r} and teacher.url={self.teacher.url!r}: distillation "
                             "needs both a coefficient > 0 and a teacher (a checkpoint or a served one); "
                             "set both, or neither")
        if self.eval.max_new_tokens > self.generation.max_new_tokens:
            raise ValueError(f"eval.max_new_tokens={self.eval.max_new_tokens} exceeds generation."
                             f"max_new_tokens={self.generation.max_new_tokens}, which the engine's context "
                             "is sized for; lower it (0: the same budget) or raise generation.max_new_tokens")
        if not self.layout.disaggregated:
            # The async section drives rollout ranks of their own; a colocated run would ignore it.
            changed = {f"async.{f.name}": getattr(self.async_, f.name) for f in fields(AsyncConfig)
                       if getattr(self.async_, f.name) != getattr(AsyncConfig(), f.name)}
            if changed:
                named = ", ".join(f"{key}={value!r}" for key, value in changed.items())
                raise ValueError(f"{named}: the async section applies only to rollout ranks of their own "
                                 "(layout.rollout_world_size > 0); colocated engines generate between "
                                 "their ranks' training phases, with the newest weights, in the "
                                 "trainers' own processes: remove it, or give the engines ranks of "
                                 "their own")
            return
        # key -> (its value where refused, why): what holds on a GPU cluster too (docs/async-and-
        # agents.md, "What composes with what").
        refused = {
            # The rollout ranks judge a round's groups by their rewards (rollout_ranks/step_draws.py).
            "algo.dynamic_sampling_rounds with reward models (rm:) in algo.reward": (
                self.algo.dynamic_sampling_rounds if self.algo.reward_table.models else 0,
                "the rollout ranks judge each round's groups by their rewards, and reward models run "
                "on the trainer ranks"),
            "offload_params": (
                self.offload_params, "the trainer ranks hold no engine, so there is nothing to hand "
                                     "their memory to"),
            # Held-out sets are scored on the rollout ranks (rollout_ranks/evaluation.py).
            "eval.sets scored by reward models (rm:)": (", ".join(
                name for name, spec in self.eval.sets.items()
                if spec.reward_table(self.algo.reward_table).models),
                "reward models run on the trainer ranks, held-out sets are scored on the rollout ranks")}
        for key, (value, why) in refused.items():
            if value:
                raise ValueError(f"{key}={value} with rollout ranks of their own (layout.rollout_world_size="
                                 f"{self.layout.rollout_world_size}): {why}; turn it off or colocate the "
                                 "engines (rollout_world_size 0)")

    # Dr. GRPO's constant is the generation budget unless set: fixed for the run, whatever the
    # widths of its batches.
    @property
    def actor_config(self) -> ActorConfig:
        return replace(self.actor, norm_tokens=self.actor.norm_tokens or self.generation.max_new_tokens)

    @property
    def engine_returns_routing(self) -> bool:
        return self.generation.return_routing or self.actor.router_replay == "rollout"

    @property
    def critic_config(self) -> CriticConfig:
        return replace(self.critic, norm_tokens=self.critic.norm_tokens or self.generation.max_new_tokens)
