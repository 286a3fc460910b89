"""RolloutEngine: what the RL loop needs from an inference engine, and nothing more.

Owns the protocol and the types that cross it. Engines (vLLM today) implement it; the loop and
megarl.resharding only talk to this surface.
"""

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Protocol, Sequence, Tuple

import torch


@dataclass(frozen=True)
class SamplingConfig:
    n: int = 1                      # samples per prompt
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1                 # -1: no top-k
    max_new_tokens: int = 64
    stop_token_ids: Tuple[int, ...] = ()
    seed: Optional[int] = None

    def __post_init__(self):
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"top_k must be -1 (off) or >= 1, got {self.top_k}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")


@dataclass
class RolloutSample:
    prompt_ids: List[int]
    response_ids: List[int]
    logprobs: torch.Tensor          # [R] log-prob of each response token under the sampler
    prompt_index: int               # which prompt of the request this sample answers
    finish_reason: str = ""
    # [P + R - 1, layers, k] int16 expert ids of every token the engine fed through its layers
    # (all but the last sampled one), -1 in dense layers; engines started with return_routing
    routed_experts: Optional[torch.Tensor] = None
    # [R] int64 the policy version (training steps behind its weights) that sampled each response
    # token; streamed (asynchronous) rollouts only
    versions: Optional[torch.Tensor] = None
    # Multi-turn samples (rollout/agent/loop.py): [R] 1 on the tokens the engine generated, 0 on those
    # inserted between turns (their log-probs are 0 and never read); None: all generated
    response_mask: Optional[torch.Tensor] = None
    trajectory: Optional[List[Dict[str, Any]]] = None  # the conversation's messages, prompt first
    events: Dict[str, int] = field(default_factory=dict)  # counted agent events (turns, tool errors)


@dataclass(frozen=True)
class Placement:
    """Where this rank sits among the engines of the job: `engines` independent engines serve
    disjoint prompts; this rank belongs to engine `engine_rank`, and exactly one rank of each
    engine (its `leader`) reports that engine's samples."""
    engines: int
    engine_rank: int
    leader: bool

    def share(self, count: int) -> List[int]:
        """Indices of the `count` prompts this rank's engine serves: a contiguous block, so its
        prompts' seeds are the draw's (sample_seed, offset by the block's first prompt)."""
        size = -(-count // self.engines)
        return list(range(self.engine_rank * size, min(count, (self.engine_rank + 1) * size)))


def sample_seed(sampling: SamplingConfig, prompt: int, sample: int) -> Optional[int]:
    """The seed of sample `sample` of the `prompt`-th prompt of a draw (None: unseeded). Every sample
    of a draw gets its own seed, as vLLM gives an n-sample request seeded s the seeds s, s+1, ...:
    two prompts sharing seeds would share their random streams, and draw their samples in step (one
    seed per prompt and a seed per step made the demo's tool calls drift with frozen weights)."""
    return None if sampling.seed is None else sampling.seed + prompt * sampling.n + sample


@dataclass
class WeightUpdateReport:
    """What an engine saw during one weight update; `missing` and `unexpected` must be empty."""
    params_expected: int
    params_loaded: int
    missing: List[str] = field(default_factory=list)
    unexpected: List[str] = field(default_factory=list)


@dataclass(frozen=True)
class WeightLayout:
    """How a weight destination holds the model: `format` "vllm" (each rank its engine's own
    parameters: fused QKV and gate/up, fused experts, padded vocabulary; engines of `tp`
    consecutive ranks, experts split over an engine's ranks when `ep` == tp) or "hf" (whole HF
    tensors, on rank 0 only). megarl.models.weights.destination turns it into every rank's tensors.
    `first_rank`: the sync's rank of the destination's rank 0 (0 colocated; the first rollout
    rank on the trainer-rollout bridge). `adapters`: the destination takes the actor's LoRA
    adapters alone each sync (AdapterDestination: into LoRA slots, or merged into its weights by
    itself); the weights it takes are the base's, written once. `quantization` "fp8": a vLLM
    destination holds its linear weights in block FP8 (rollout.quantization). `router_fp32`: a
    vLLM destination holds its MoE gates in fp32 (model.router_fp32; models/weights/engine_fp32.py)."""
    format: str
    world: int
    tp: int = 1
    ep: int = 1
    first_rank: int = 0
    adapters: bool = False
    quantization: str = "none"
    router_fp32: bool = True


class WeightDestination(Protocol):
    """What megarl.resharding.sync_weights writes into: tensors opened a module at a time, written
    in place, then closed (the destination makes them live: vLLM repacks, an exporter saves)."""

    def weight_layout(self) -> WeightLayout:
        ...

    def begin_weight_update(self, expected: Dict[str, Tuple[int, ...]]) -> None:
        """Prepare to receive a complete new set of weights: `expected` is this rank's tensors
        (name -> shape) as the plan will write them; refuse if they are not exactly the
        destination's own."""

    def open_tensors(self, names: Sequence[str]) -> Dict[str, torch.Tensor]:
        """Writable tensors of these names (whole modules), uninitialized."""

    def close_tensors(self, names: Sequence[str]) -> None:
        """Every element of these tensors is written: make them live."""

    def finish_weight_update(self) -> WeightUpdateReport:
        """Finalize; report every destination tensor that was or was not written."""


class AdapterDestination(WeightDestination, Protocol):
    """A destination whose layout has `adapters` (megarl.resharding.adapter_sync writes into it)."""

    def needs_base_weights(self) -> bool:
        """The next sync must write the base weights first (the first one, or after they were lost)."""

    def load_adapters(self, tensors: Dict[str, torch.Tensor]) -> None:
        """Every adapter tensor, whole, under its PEFT name: generate with them from now on."""


class RolloutEngine(WeightDestination, Protocol):
    placement: Placement

    def generate(self, prompts: Sequence[List[int]], sampling: SamplingConfig) -> List[RolloutSample]:
        """Sample `sampling.n` responses per prompt (token ids in, token ids and log-probs out)."""

    def release_memory(self) -> None:
        """Free generation memory (KV cache, and weights where supported) while training runs."""

    def resume_memory(self, weights: bool = True, kv_cache: bool = True) -> None:
        """Re-acquire what release_memory freed: the weights before a weight update, both before
        the next generate. Updates and generation refuse to run into released memory."""

    def shutdown(self) -> None:
        ...


@dataclass(frozen=True)
class Progress:
    """What a streamed request generated in one engine step: the tokens it added (since its
    previous Progress) and their log-probs."""
    request_id: str
    token_ids: List[int]
    logprobs: List[float]
    finished: bool
    finish_reason: str = ""
    # Once finished, on engines started with return_routing: [prompt + response - 1, layers, k]
    # int16, the experts of every id the request fed through the engine's layers
    routed_experts: Optional[torch.Tensor] = None


class StreamingEngine(RolloutEngine, Protocol):
    """An engine driven one scheduler step at a time, so requests can be interrupted at a weight
    update and a conversation's next turn submitted as soon as its tools answer: megarl/rollout/
    turns.py drives it for every producer."""

    def submit(self, request_id: str, prompt_ids: List[int], sampling: SamplingConfig) -> None:
        """Queue one sample (sampling.n must be 1)."""

    def step(self) -> List[Progress]:
        """One scheduler step; the requests that progressed."""

    def abort(self, request_ids: Sequence[str]) -> None:
        ...

    def from_leader(self, decide: Callable[[], Any]) -> Any:
        """decide() run on this engine's leader; what it returned, on every rank of the engine."""


def check_update(report: WeightUpdateReport) -> WeightUpdateReport:
    """Raise if a weight update left engine parameters unwritten or wrote unknown ones."""
    if report.missing or report.unexpected:
        raise RuntimeError(
            f"weight update incomplete: {len(report.missing)} engine parameters not written "
            f"(e.g. {report.missing[:5]}), {len(report.unexpected)} unexpected "
            f"(e.g. {report.unexpected[:5]}); the sync plan and the engine's model disagree"
        )
    return report
