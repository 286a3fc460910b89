"""The colocated memory handoff: training state off the accelerator while vLLM syncs and
generates, and back.

Owns which storages of a TrainState move (optimizer moments, fp32 main params that are not the
model's own parameters, gradients; the model's parameters when asked, separately), their host
copies, and the order of the handoff around the engine and its weight sync
(`device_to_engine`). Does not own the engine's memory (RolloutEngine.resume_memory /
release_memory), the sync itself (passed in as a callable) or when the loop hands off.

Only device-resident state moves. With Megatron's optimizer offload (`optimizer_offload.fraction`,
HybridDeviceOptimizer) the host sub-optimizers' fp32 params, moments and pinned gradient copies
live in host memory already: they are neither copied again nor counted as freed. Which state is
which is read from the structure (the sub-optimizer holding it), not from `tensor.device`: on a
GPU the two agree by Megatron's construction, and on the CPU, where every tensor is a host one, a
test can still tell them apart.

Same code on CPU and GPU: each storage's bytes are copied into a fresh host buffer (pinned when
CUDA is present), then the storage is resized to 0 bytes. That frees it while every tensor viewing
it (parameters, param.main_grad, distributed-optimizer shards) keeps its shape, and resizing it
back makes them valid again. On CPU this really frees and restores memory, so a CPU test proves
nothing is lost. (Megatron's own offload_to_cpu/reload_from_cpu do nothing off CUDA.)
"""

import contextlib
from dataclasses import dataclass, field
from typing import Callable, Iterator, List, Sequence, Tuple

import torch
from megatron.core.optimizer.cpu_offloading import HybridDeviceOptimizer

from megarl.actor.optimizer import TrainState
from megarl.platform import device_choice
from megarl.rollout.engine import RolloutEngine


@dataclass
class Offloaded:
    """What `offload` took from one TrainState; give it to `reload` to put it back.
    copies: (freed device storage, its host copy as uint8 [bytes]); grads: (freed storage, bytes)."""
    copies: List[Tuple[torch.UntypedStorage, torch.Tensor]] = field(default_factory=list)
    grads: List[Tuple[torch.UntypedStorage, int]] = field(default_factory=list)

    @property
    def host_bytes(self) -> int:
        """Bytes copied to the host."""
        return sum(host.numel() for _, host in self.copies)

    @property
    def freed_bytes(self) -> int:
        """Bytes freed on the device: the host copies plus the gradients, which need no copy."""
        return self.host_bytes + sum(nbytes for _, nbytes in self.grads)


def _bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    """A uint8 tensor [storage bytes] over the whole storage."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def distinct_storages(tensors) -> List[torch.UntypedStorage]:
    """The distinct non-empty storages under `tensors` (views of one buffer share one)."""
    seen = {}
    for t in tensors:
        storage = t.untyped_storage()
        if storage.size() and storage.data_ptr() not in seen:
            seen[storage.data_ptr()] = storage
    return list(seen.values())


def _inner_optimizers(state: TrainState) -> List[torch.optim.Optimizer]:
    """The torch optimizer inside each of `state`'s Megatron optimizers (none on a rank holding
    no parameters of one)."""
    return [opt.optimizer for opt in getattr(state.optimizer, "chained_optimizers", [state.optimizer])
            if getattr(opt, "optimizer", None) is not None]


def _device_side(inner: torch.optim.Optimizer) -> list:
    """The optimizers of one inner optimizer that step on the device: a HybridDeviceOptimizer's
    device sub-optimizer (its host ones hold what its offload keeps in host memory: fp32 copies,
    moments, pinned gradient copies); any other optimizer itself."""
    if isinstance(inner, HybridDeviceOptimizer):
        return [inner.gpu_optimizer] if inner.gpu_optimizer is not None else []
    return [inner]


def _params_and_moments(optimizers) -> Tuple[list, list]:
    """(params, moment tensors) of torch optimizers. Adam's `step` counters are 0-dim host
    tensors even on GPU: they stay where they are."""
    params = [p for opt in optimizers for group in opt.param_groups for p in group["params"]]
    moments = [v for opt in optimizers for s in opt.state.values() for v in s.values()
               if isinstance(v, torch.Tensor) and v.dim() > 0]
    return params, moments


def _optimizer_tensors(state: TrainState):
    """(main params, moment tensors) the device holds: every inner optimizer's, a
    HybridDeviceOptimizer's device sub-optimizer's alone (its fp32 copies of the parameters it
    steps, and their moments)."""
    return _params_and_moments([o for inner in _inner_optimizers(state) for o in _device_side(inner)])


def offload(state: TrainState, *, optimizer: bool = True, params: bool = False) -> Offloaded:
    """Free on the device `state`'s optimizer moments, separate main params (bf16 models) and
    gradients when `optimizer` (the device-resident ones: not what Megatron's optimizer offload
    keeps in host memory), its model parameters when `params`. Storages already freed are skipped,
    so the two parts can go in separate calls, each reloaded from its own Offloaded. Until
    `reload`, the model may not run (with its parameters kept, its weights can still be read,
    e.g. by a weight sync)."""
    param_storages = distinct_storages(p for chunk in state.model for p in chunk.parameters())
    to_copy, grads = [], []
    if optimizer:
        param_ptrs = {s.data_ptr() for s in param_storages}
        main, moments = _optimizer_tensors(state)
        # fp32 models' main params are views of the parameters: they move with the parameters.
        to_copy += distinct_storages(moments + [p for p in main
                                                if p.untyped_storage().data_ptr() not in param_ptrs])
        grads = distinct_storages(buffer.grad_data for chunk in state.model
                                  for buffer in chunk.buffers + chunk.expert_parallel_buffers)
    if params:
        to_copy += param_storages
    return to_host(to_copy, grads)


def to_host(storages: Sequence[torch.UntypedStorage],
            grads: Sequence[torch.UntypedStorage] = ()) -> Offloaded:
    """Free `storages` on the device, their bytes copied to the host first, and `grads` (not
    copied: zeroed when reloaded). Every tensor viewing them keeps its shape; `reload` makes them
    valid again. The one mechanism of every offload (the actor's here, a colocated teacher's)."""
    # Copy everything before freeing anything: a failed copy (host out of memory) loses nothing.
    # Blocking copies, so the host holds the bytes before the device storage is reused.
    # Fresh host buffers each time: torch caches pinned blocks, so from the second handoff on the
    # same sizes are not pinned again (one H100: first offload 1.5-6 GB/s, later ~30 GB/s).
    done = Offloaded()
    for storage in storages:
        host = torch.empty(storage.size(), dtype=torch.uint8, pin_memory=device_choice.on_gpu())
        host.copy_(_bytes(storage))
        done.copies.append((storage, host))
    for storage, _ in done.copies:
        storage.resize_(0)
    for storage in grads:
        done.grads.append((storage, storage.size()))
        storage.resize_(0)
    if device_choice.on_gpu():
        torch.cuda.empty_cache()  # the engine allocates outside torch's cache: hand the memory back
    return done


def reload(offloaded: Offloaded) -> None:
    """Re-allocate what `offload` freed: copies restored bit for bit, gradients zeroed (every
    step zeroes them before use anyway)."""
    for storage, host in offloaded.copies:
        storage.resize_(host.numel())
        _bytes(storage).copy_(host)
    for storage, nbytes in offloaded.grads:
        storage.resize_(nbytes)
        _bytes(storage).zero_()
    # Drop the host copies now, not when the caller drops this object; a second reload is a no-op.
    offloaded.copies.clear()
    offloaded.grads.clear()


@contextlib.contextmanager
def device_to_engine(synced: TrainState, others: Sequence[TrainState], engine: RolloutEngine,
                     sync: Callable[[], None], offload_params: bool) -> Iterator[int]:
    """Hand the device to the engine for one weight sync and generation, and back:
    optimizer state and gradients of every state off (with `offload_params`, the parameters of
    `others` too) -> the engine's weights woken -> `sync()`, which reads `synced`'s parameters ->
    with `offload_params`, `synced`'s parameters off -> the KV cache woken -> the block ->
    engine.release_memory() -> everything reloaded. Undone in reverse order from wherever it
    raises. Yields the bytes freed on the device (all states together).

    The weights wake only once training state has left the device (offload empties the
    allocator's cache on GPU), and the KV cache, the engine's largest part, only once the sync
    no longer needs `synced`'s parameters there."""
    offloaded = []
    try:
        offloaded.append(offload(synced))  # its parameters stay: they are the sync's source
        for state in others:
            offloaded.append(offload(state, params=offload_params))
        try:
            engine.resume_memory(kv_cache=False)
            sync()
            if offload_params:
                offloaded.append(offload(synced, optimizer=False, params=True))
            engine.resume_memory(weights=False)
            yield sum(o.freed_bytes for o in offloaded)
        finally:
            engine.release_memory()
    finally:
        for o in reversed(offloaded):
            reload(o)
