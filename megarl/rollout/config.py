"""The rollout side's sections of a run's config: the prompt data (`data`), generation
(`generation`) and asynchronous rollouts (`async`), beside the rollout code that reads them; and
EngineSpec, the engine settings a run derives from its other sections. Typed and validated when
built (megarl.planning.typed_config), before any process starts.
Does not own the run's config as a whole (megarl/planning/config.py composes these sections with
the others) or what reads them (prompts.py, builder.py, turns.py, the trainer's rollout sources).
"""

from dataclasses import dataclass, field
from typing import Optional

from megarl.rollout.agent.loop import AgentConfig
from megarl.rollout.prompts import OVERLONG, RecordKeys
from megarl.rollout.turns import INTERRUPTS
from megarl.rollout.vllm.lora import AdapterSpec


@dataclass(frozen=True)
class DataConfig:
    path: str = ""  # .jsonl or .parquet
    # Key paths in each record, dotted for nested fields (rollout/prompts.py): the prompt (text or
    # chat messages), the ground truth ("auto": `answer`, else verl's `reward_model.ground_truth`),
    # and what reward functions with verl's signature also get.
    prompt_key: str = "prompt"
    answer_key: str = "auto"
    data_source_key: str = "data_source"
    extra_info_key: str = "extra_info"
    max_prompt_len: int = 256
    overlong_prompts: str = "skip"  # prompts over max_prompt_len tokens: "skip" (and count) or "error"
    prompts_per_step: int = 8
    seed: int = 0

    @property
    def keys(self) -> RecordKeys:
        return RecordKeys(self.prompt_key, self.answer_key, self.data_source_key, self.extra_info_key)

    def __post_init__(self):
        if not self.path:
            raise ValueError("data.path is required (a .jsonl or .parquet file of prompts)")
        if self.prompts_per_step < 1 or self.max_prompt_len < 1:
            raise ValueError(f"data.prompts_per_step={self.prompts_per_step} and data.max_prompt_len="
                             f"{self.max_prompt_len} must be >= 1")
        if self.overlong_prompts not in OVERLONG:
            raise ValueError(f"data.overlong_prompts={self.overlong_prompts!r}; choose one of {OVERLONG}")


@dataclass(frozen=True)
class GenerationConfig:
    samples_per_prompt: int = 4
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 64
    # How samples are produced: completion, agent (multi-turn with tools and interactions,
    # configured by `agent`: megarl/rollout/agent/loop.py) or module:function
    producer: str = "completion"
    agent: AgentConfig = field(default_factory=AgentConfig)
    kv_cache_gib: int = 1  # CPU: vLLM's KV cache size
    gpu_memory_utilization: float = 0.5  # GPU: vLLM's share of each device (weights + KV cache)
    # MoE: the engine returns each token's experts, for the routing-mismatch metric (always on
    # with actor.router_replay=rollout, which replays them)
    return_routing: bool = False

    def __post_init__(self):
        if not 0 < self.gpu_memory_utilization < 1:
            raise ValueError(f"generation.gpu_memory_utilization={self.gpu_memory_utilization} must lie "
                             "in (0, 1): the training state shares the device")


# rollout.quantization: "fp8" builds engines of block-FP8 linear weights (rollout/vllm/fp8_engine.py)
QUANTIZATIONS = ("none", "fp8")


@dataclass(frozen=True)
class RolloutConfig:
    """The rollout engines' own weights. YAML key `rollout`."""
    # "fp8": the engines hold the linear weights a block-FP8 checkpoint quantizes (DeepSeek-V3's
    # format: float8 e4m3 codes, an fp32 scale per 128x128 block) and the rest in the model's dtype,
    # quantized from the trainer's weights at each sync: half the engine's weight memory
    quantization: str = "none"

    def __post_init__(self):
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"rollout.quantization={self.quantization!r} is not supported: choose one of "
                             f"{QUANTIZATIONS} ('fp8': block-FP8 engine weights, 128x128 blocks)")


@dataclass(frozen=True)
class AsyncConfig:
    """Off-policy steps (rollout ranks of their own: layout.rollout_world_size). YAML key `async`."""
    # Rollouts for the next steps are generated while a step trains, with weights at most this many
    # versions (steps) older than the trainer's; 0 is the synchronous loop.
    max_staleness: int = 0
    # Requests in flight at a weight update: "continue" with the new weights from the tokens so far
    # (partial rollout), or "restart" them from their prompt.
    partial_rollout: str = "continue"
    # A rollout engine process that dies is replaced (and gets the current weights) this many
    # times in a run before the run ends.
    max_engine_restarts: int = 3

    def __post_init__(self):
        if self.max_staleness < 0:
            raise ValueError(f"async.max_staleness={self.max_staleness} must be >= 0 (0: synchronous)")
        if self.max_engine_restarts < 0:
            raise ValueError(f"async.max_engine_restarts={self.max_engine_restarts} must be >= 0")
        if self.partial_rollout not in INTERRUPTS:
            raise ValueError(f"async.partial_rollout={self.partial_rollout!r}; choose one of {INTERRUPTS}")


@dataclass(frozen=True)
class EngineSpec:
    """What a run's engines are made of besides the data and generation sections, gathered from
    the others (planning/resolved.engine_spec): not a YAML section, derived, never written back."""
    hf_dir: str  # the policy's checkpoint: architecture and tokenizer (weights come from the sync)
    dtype: str  # the checkpoint's (ModelArch.dtype)
    seed: int
    rollout_tp: int = 1
    rollout_ep: int = 1
    return_routing: bool = False  # each sample carries its tokens' experts (MoE)
    router_fp32: bool = True  # MoE gates in fp32, as the trainer's
    adapters: Optional[AdapterSpec] = None  # the actor's LoRA adapters, synced alone
    quantization: str = "none"  # rollout.quantization
