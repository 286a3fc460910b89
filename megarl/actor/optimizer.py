"""The trained state of a model (actor or critic): Megatron DDP, its optimizer and LR schedule.

Owns OptimConfig and OptimizerOffloadConfig (validated before anything is built), the Megatron
OptimizerConfig they make, one optimizer step over packed micro-batches, and the pure sizes the
memory planner takes from them: Adam's state per element (optimizer_bytes) and a step's transient
memory for the Adam Megatron builds (built_adam, step_transient_bytes). Gradients are
*summed* over micro-batches and data-parallel ranks: every loss megarl returns is already that
micro-batch's share of the global-batch loss (algos/aggregation), so nothing may divide again.
Megatron's per-token-loss mode gives exactly that sum in DDP; the division by a token count that
mode normally applies afterwards is skipped.
Does not own losses or data.
"""

from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

import torch
from megatron.core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
)
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from megarl.actor.packing import PackedMicroBatch
from megarl.actor.schedule import run_micro_batches
from megarl.platform import device_choice

LR_DECAY_STYLES = ("constant", "linear", "cosine")
# Adam moment dtypes of Megatron's precision-aware optimizer (Megatron-LM's --exp-avg-dtype: fp8
# is TE FusedAdam's uint8 storage with a scale).
MOMENT_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.uint8}


@dataclass(frozen=True)
class OptimConfig:
    lr: float = 1e-6
    min_lr: float = 0.0
    lr_warmup_steps: int = 0
    lr_decay_steps: Optional[int] = None  # optimizer steps to decay over; None: no decay
    lr_decay_style: str = "constant"
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    clip_grad: float = 1.0  # max global gradient norm; 0 disables clipping
    use_distributed_optimizer: bool = True

    def __post_init__(self):
        if self.lr <= 0 or self.min_lr < 0 or self.min_lr > self.lr:
            raise ValueError(f"need 0 <= min_lr <= lr and lr > 0, got lr={self.lr}, min_lr={self.min_lr}")
        if self.lr_decay_style not in LR_DECAY_STYLES:
            raise ValueError(f"lr_decay_style={self.lr_decay_style!r}; choose one of {LR_DECAY_STYLES}")
        if self.lr_decay_style != "constant" and not self.lr_decay_steps:
            raise ValueError(f"lr_decay_style={self.lr_decay_style!r} needs lr_decay_steps (the number "
                             "of optimizer steps to decay over)")
        if self.lr_warmup_steps < 0 or self.clip_grad < 0:
            raise ValueError(f"lr_warmup_steps={self.lr_warmup_steps} and clip_grad={self.clip_grad} "
                             "must be >= 0")


@dataclass(frozen=True)
class OptimizerOffloadConfig:
    """Where Adam's state lives and how wide its moments are: `actor.optimizer_offload` /
    `critic.optimizer_offload`. Needs the distributed optimizer (optim.use_distributed_optimizer).

    fraction > 0 is Megatron's optimizer_cpu_offload: that share of each rank's optimizer shard
    (by elements, in parameter order) keeps its fp32 main copy and moments in host memory and is
    stepped there by torch's AdamW; gradients go to the host and the new weights come back every
    step (HybridDeviceOptimizer). Its moments stay fp32.
    exp_avg_dtype / exp_avg_sq_dtype (fp32 | bf16 | fp16 | fp8) below fp32 are Megatron's
    precision-aware optimizer: the moments stay on the GPU at that width, which only Transformer
    Engine's FusedAdam does."""
    fraction: float = 0.0
    exp_avg_dtype: str = "fp32"
    exp_avg_sq_dtype: str = "fp32"

    def __post_init__(self):
        if not 0.0 <= self.fraction <= 1.0:
            raise ValueError(f"optimizer_offload.fraction={self.fraction} must be in [0, 1] (the share "
                             "of the optimizer state kept and stepped on the host; 0: none)")
        for name in ("exp_avg_dtype", "exp_avg_sq_dtype"):
            if getattr(self, name) not in MOMENT_DTYPES:
                raise ValueError(f"optimizer_offload.{name}={getattr(self, name)!r}; choose one of "
                                 f"{list(MOMENT_DTYPES)}")
        if self.fraction and self.narrow_moments:
            # optimizer/__init__.py builds HybridDeviceOptimizer without the moment dtypes.
            raise ValueError(f"optimizer_offload.fraction={self.fraction} keeps Adam's moments in fp32 "
                             f"(Megatron's offload ignores exp_avg_dtype={self.exp_avg_dtype!r} and "
                             f"exp_avg_sq_dtype={self.exp_avg_sq_dtype!r}): set both to fp32, or "
                             "fraction to 0 for narrow moments on the GPU")

    @property
    def narrow_moments(self) -> bool:
        return (self.exp_avg_dtype, self.exp_avg_sq_dtype) != ("fp32", "fp32")

    @property
    def active(self) -> bool:
        return bool(self.fraction) or self.narrow_moments


NO_OFFLOAD = OptimizerOffloadConfig()
# DDP's gradient buffer (param.main_grad) is fp32 whatever the model's dtype: the reduce and the
# optimizer read exact sums (TrainState's grad_reduce_in_fp32).
GRAD_DTYPE = torch.float32


FP32 = 4
# The Adam Megatron-Core 0.16 builds (megatron/core/optimizer/__init__.py, chosen once at import):
# Transformer Engine's FusedAdam when transformer_engine imports, else Apex's FusedAdam, else
# torch.optim.AdamW. Their steps allocate differently (step_transient_bytes).
ADAM_KINDS = ("te", "apex", "torch")


def optimizer_bytes(params_dtype: torch.dtype, offload: OptimizerOffloadConfig) -> Tuple[float, float]:
    """Pure: (device, host) bytes of Adam state per element of a rank's optimizer shard: the fp32
    main copy (none for fp32 parameters: they are their own) and the two moments, the offloaded
    fraction of them on the host (Megatron's HybridDeviceOptimizer), with the fp32 gradient copy
    that optimizer keeps there for its host part (pinned, made at the first step)."""
    main = 0 if params_dtype == torch.float32 else FP32
    moments = (MOMENT_DTYPES[offload.exp_avg_dtype], MOMENT_DTYPES[offload.exp_avg_sq_dtype])
    per = main + sum(dtype.itemsize for dtype in moments)
    host = (FP32 + FP32 + 2 * FP32) if offload.fraction else 0  # its fp32 copy, grad copy, moments
    return per * (1 - offload.fraction), host * offload.fraction


def built_adam() -> str:
    """The Adam Megatron-Core builds in this environment (one of ADAM_KINDS)."""
    from megatron.core import optimizer as megatron_optimizer

    module = megatron_optimizer.Adam.__module__
    return "te" if module.startswith("transformer_engine") else "apex" if module.startswith("apex") \
        else "torch"


def step_transients(adam: str, on_gpu: bool, offload: OptimizerOffloadConfig, group: int, tensor: int,
                    clip: bool) -> Dict[str, float]:
    """Pure: the most device bytes each part of one optimizer step allocates beyond the state it
    steps, for `adam` (ADAM_KINDS) on a GPU or the CPU. `group`: the elements of the largest
    parameter group one Adam call steps (of a rank's optimizer shard: Megatron's dense or expert
    optimizer); `tensor`: those of the largest single tensor in it; `clip`: clip_grad > 0.
      finite  megarl's check before the step (TrainState.step: aminmax per gradient buffer): none
      clip    TE's and Apex's multi_tensor_scale scale in place; without them Megatron's
              local_multi_tensor_scale writes dst.copy_(src * scale), one fp32 tensor at a time
      adam    torch's AdamW with neither foreach nor fused set: multi-tensor on CUDA, whose
              _foreach_sqrt(exp_avg_sqs) holds an fp32 copy of the group's second moment; per
              tensor on the CPU (no foreach kernels there), where a tensor's denominator (its sqrt,
              then the quotient) is made while the previous tensor's is still held: at most three
              fp32 tensors, s[i-1] + 2 s[i]. TE's FusedAdam: in place for fp32 moments; each
              narrower moment (bf16, fp16, fp8) is unscaled to an fp32 copy for the whole group
              before the kernel (get_unscaled_state), a bf16 one cast back a tensor at a time.
              Apex's: in place (fp32 moments only). With the offload, HybridDeviceOptimizer builds
              both parts with fused=True (in place); the host part's new weights come back by a
              non-blocking copy_ of fp32 host tensors into the bf16 parameters, which converts on
              the GPU through an fp32 staging tensor (ATen's copy_kernel_cuda), a tensor at a time."""
    if adam not in ADAM_KINDS:
        raise ValueError(f"adam={adam!r}: one of {ADAM_KINDS} (the Adam Megatron-Core builds: TE's "
                         "FusedAdam, Apex's FusedAdam, or torch.optim.AdamW)")
    if offload.fraction:
        step = FP32 * tensor if on_gpu else 0
    elif adam == "torch":
        step = FP32 * group if on_gpu else 3 * FP32 * tensor
    else:
        narrow = [name for name in (offload.exp_avg_dtype, offload.exp_avg_sq_dtype) if name != "fp32"]
        step = FP32 * group * len(narrow) + (2 * tensor if "bf16" in narrow else 0)
    return {"finite": 0.0, "clip": float(FP32 * tensor if clip and adam == "torch" else 0),
            "adam": float(step)}


def step_transient_bytes(adam: str, on_gpu: bool, offload: OptimizerOffloadConfig, group: int, tensor: int,
                         clip: bool) -> float:
    """Pure: a step's transient peak: its parts (step_transients) run in turn, each freeing its
    temporaries before the next."""
    return max(step_transients(adam, on_gpu, offload, group, tensor, clip).values())


def check_offload(optim: OptimConfig, offload: OptimizerOffloadConfig, section: str) -> None:
    """Megatron offloads and narrows only the distributed optimizer's state
    (OptimizerConfig.__post_init__ asserts it for the precision-aware optimizer, which the offload
    rides on)."""
    if offload.active and not optim.use_distributed_optimizer:
        raise ValueError(f"{section}.optimizer_offload ({offload}) needs the distributed optimizer: "
                         f"set {section}.optim.use_distributed_optimizer=true")


def offload_fields(offload: OptimizerOffloadConfig, params_dtype: torch.dtype, on_gpu: bool,
                   use_te: bool) -> dict:
    """Pure: Megatron OptimizerConfig fields of `offload` on this machine; ValueError naming the
    value and the fix where the machine cannot run it."""
    if not offload.active:
        return {}
    if offload.narrow_moments and not use_te:
        raise ValueError(f"optimizer_offload.exp_avg_dtype={offload.exp_avg_dtype!r} / exp_avg_sq_dtype="
                         f"{offload.exp_avg_sq_dtype!r}: moments narrower than fp32 need Transformer "
                         "Engine's FusedAdam on a GPU (Megatron's precision-aware optimizer, "
                         "optimizer_config.py), absent here: keep fp32 moments, or offload them "
                         "(optimizer_offload.fraction)")
    if offload.fraction and params_dtype == torch.float32:
        # distrib_optimizer.py:415 hands it fp32 parameters' shards as views of the parameters,
        # which torch.optim refuses ("can't optimize a non-leaf Tensor"); bf16 shards are detached.
        raise ValueError(f"optimizer_offload.fraction={offload.fraction} needs a bf16 or fp16 model "
                         "(Megatron 0.16's offload cannot step float32 parameters): train in bf16, "
                         "or set fraction to 0")
    if offload.narrow_moments:
        return dict(use_precision_aware_optimizer=True, exp_avg_dtype=MOMENT_DTYPES[offload.exp_avg_dtype],
                    exp_avg_sq_dtype=MOMENT_DTYPES[offload.exp_avg_sq_dtype])
    # Megatron-LM requires the precision-aware optimizer with the offload: HybridDeviceOptimizer
    # holds the main params and reads the gradients (`decoupled_grad`) on that flag's code path.
    return dict(optimizer_cpu_offload=True, optimizer_offload_fraction=offload.fraction,
                use_precision_aware_optimizer=True, pin_cpu_grads=on_gpu, pin_cpu_params=on_gpu)


def _per_chunk(funcs: list):
    """Megatron's schedules take one function for a single chunk and a list for VPP chunks."""
    return funcs[0] if len(funcs) == 1 else funcs


def _sum_grads(model, num_tokens=None, **kwargs):
    # The losses are global-batch shares already: reduce over DP without dividing by num_tokens.
    return finalize_model_grads(model, None, **kwargs)


def lr_scheduler(optimizer, config: OptimConfig) -> OptimizerParamScheduler:
    """Megatron's scheduler over `optimizer.param_groups`; call .step(increment=1) per step."""
    decay_steps = max(config.lr_decay_steps or 1, config.lr_warmup_steps + 1)
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=0.0, max_lr=config.lr, min_lr=config.min_lr,
        lr_warmup_steps=config.lr_warmup_steps, lr_decay_steps=decay_steps,
        lr_decay_style=config.lr_decay_style, start_wd=config.weight_decay,
        end_wd=config.weight_decay, wd_incr_steps=decay_steps, wd_incr_style="constant")
    if config.lr_warmup_steps:
        # Megatron's warmup starts at init_lr (0) on step 0, a wasted step; start at lr/warmup
        # and reach lr on the warmup's last step instead.
        scheduler.step(increment=1)
    return scheduler


class TrainState:
    """DDP-wrapped chunks + Megatron optimizer (distributed when configured) + LR scheduler."""

    def __init__(self, chunks: List[torch.nn.Module], config: OptimConfig,
                 offload: OptimizerOffloadConfig = NO_OFFLOAD):
        model_config = chunks[0].config
        offloaded = offload_fields(offload, model_config.params_dtype, device_choice.on_gpu(),
                                   device_choice.uses_transformer_engine())
        model_config.calculate_per_token_loss = True  # DDP reads it when built: sum, not average
        model_config.finalize_model_grads_func = _sum_grads
        # On GPUs the gradient reduce of a bucket overlaps the rest of the backward (NCCL streams);
        # over gloo it would only add threads to a 2-core box.
        overlap = device_choice.on_gpu()
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=GRAD_DTYPE == torch.float32, overlap_grad_reduce=overlap,
            use_distributed_optimizer=config.use_distributed_optimizer)
        self.chunks, self.clip_grad = chunks, config.clip_grad
        self.model = [DistributedDataParallel(model_config, ddp_config, c) for c in chunks]
        if overlap:
            # As Megatron-LM's training loop wires it: no bucket reduces before the last
            # micro-batch, and the pipeline schedule starts each chunk's reduce when its last
            # backward is done (finalize_model_grads waits for them).
            model_config.no_sync_func = _per_chunk([m.no_sync for m in self.model])
            model_config.grad_sync_func = _per_chunk([m.start_grad_sync for m in self.model])
        self.optimizer = get_megatron_optimizer(
            OptimizerConfig(optimizer="adam", lr=config.lr, min_lr=config.min_lr,
                            weight_decay=config.weight_decay, adam_beta1=config.adam_beta1,
                            adam_beta2=config.adam_beta2, adam_eps=config.adam_eps,
                            clip_grad=config.clip_grad,
                            use_distributed_optimizer=config.use_distributed_optimizer,
                            params_dtype=model_config.params_dtype, bf16=model_config.bf16,
                            fp16=model_config.fp16, **offloaded),
            self.model, use_gloo_process_groups=False)
        self.scheduler = lr_scheduler(self.optimizer, config)

    def state_bytes(self) -> int:
        """Bytes of the optimizer state this rank holds (Adam's moments, made at the first step):
        what LoRA shrinks to the adapters'."""
        total = 0
        for optimizer in getattr(self.optimizer, "chained_optimizers", [self.optimizer]):
            for state in optimizer.optimizer.state.values():
                total += sum(t.numel() * t.element_size() for t in state.values()
                             if torch.is_tensor(t) and t.dim() > 0)
        return total

    def train_mode(self, training: bool) -> None:
        for chunk in self.model:
            chunk.train(training)

    def step(self, micro_batches: List[PackedMicroBatch], make_loss: Callable,
             around_forward: Optional[Callable] = None):
        """Forward+backward over `micro_batches`, then one optimizer step unless a gradient on any
        rank is not finite (a NaN/inf loss or gradient): then weights, optimizer moments and the LR
        schedule stay as they were. Returns (loss outputs on the last stage, gradient norm before
        clipping (nan when skipped), learning rate used, whether the step was skipped)."""
        self.train_mode(True)
        for chunk in self.model:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        outputs = run_micro_batches(self.model, micro_batches, make_loss, forward_only=False,
                                    around_forward=around_forward)
        lr = self.optimizer.param_groups[0]["lr"]
        if not _grads_finite(self.model):
            return outputs, float("nan"), lr, True
        # Megatron skips by itself only where it scales losses (fp16's overflow check).
        updated, grad_norm, _ = self.optimizer.step()
        if not self.clip_grad:  # Megatron measures the norm only to clip (None or 0.0 otherwise)
            grad_norm = self.optimizer.get_grad_norm()
        if updated:
            self.scheduler.step(increment=1)
        return outputs, float(grad_norm), lr, not updated


def _grads_finite(model: List[DistributedDataParallel]) -> bool:
    """Whether every gradient on every rank is finite. All ranks must agree: a rank that stepped
    alone would leave the model replicas different."""
    buffers = [b.grad_data for chunk in model for b in chunk.buffers + chunk.expert_parallel_buffers]
    # Each buffer's min and max are finite exactly when all of it is (both are NaN where any
    # element is; +-inf shows in one of them): one read, two scalars. torch.isfinite(g) held
    # 7 bytes per element (its ==, abs, != and product at once), 21.8 GB on the H200's 3.1B-
    # parameter slice (docs/gpu/h200_2026-11-28.json).
    finite = all(bool(torch.isfinite(torch.stack(torch.aminmax(g))).all()) for g in buffers if g.numel())
    flag = torch.tensor([float(finite)], device=buffers[0].device if buffers else None)
    torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MIN)
    return bool(flag.item())
