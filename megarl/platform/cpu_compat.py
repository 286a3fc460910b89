"""Megatron-Core on a machine without CUDA: the small set of shims that make it run over gloo.

Owns every CPU workaround for Megatron-Core and nothing else: the CPU path is always without
Transformer Engine too, and those shims are no_te_compat's, installed beside these. Active only on
the CPU path (`install()` returns without touching anything on the GPU path).

Scoping: Megatron-Core modules call `torch.cuda.*` and build tensors with `device="cuda"`. Rather
than patching `torch.cuda` itself (which would change how vLLM and every other library see the
machine), we give each Megatron-Core module its own `torch` name bound to a proxy: the real torch
module except for a `cuda` namespace that answers for the CPU. Code outside megatron.core sees
the unmodified torch.
"""

import contextlib
import importlib
import sys
import types

import torch

from megarl.platform import device_choice
from megarl.platform.uneven_collectives import all_gather_uneven, reduce_scatter_uneven

_CPU = torch.device("cpu")
_FACTORIES = ("empty", "zeros", "ones", "full", "tensor", "arange", "randn", "rand", "empty_like",
              "zeros_like", "ones_like")


class _CpuStream:
    """Stands in for torch.cuda.Stream/Event: work on the CPU is already ordered."""

    def wait_stream(self, other):
        pass

    def record_event(self, *args, **kwargs):
        return self

    def synchronize(self):
        pass

    def wait_event(self, event):
        pass

    def wait(self, stream=None):
        pass

    def __eq__(self, other):
        return isinstance(other, _CpuStream)

    def __hash__(self):
        return 0


_STREAM = _CpuStream()


def _cuda_namespace() -> types.SimpleNamespace:
    return types.SimpleNamespace(
        current_device=lambda: _CPU,
        device_count=lambda: 0,
        is_available=lambda: False,
        synchronize=lambda *a, **k: None,
        empty_cache=lambda: None,
        Stream=lambda *a, **k: _STREAM,
        Event=lambda *a, **k: _STREAM,
        current_stream=lambda *a, **k: _STREAM,
        stream=lambda s: contextlib.nullcontext(),
        nvtx=types.SimpleNamespace(range_push=lambda *a, **k: None,
                                   range_pop=lambda *a, **k: None),
        memory_allocated=lambda *a, **k: 0,
        max_memory_allocated=lambda *a, **k: 0,
        amp=torch.amp,
        get_rng_state=torch.get_rng_state,
        set_rng_state=torch.set_rng_state,
        manual_seed=lambda seed: None,  # the CPU generator is seeded by megarl, not by Megatron
        CUDAGraph=object,
    )


def _to_cpu_device(kwargs: dict) -> dict:
    device = kwargs.get("device")
    if device is not None and (device == "cuda" or getattr(device, "type", None) == "cuda"
                               or isinstance(device, int)):
        kwargs["device"] = _CPU
    return kwargs


class _TorchForMegatron(types.ModuleType):
    """`torch` as Megatron-Core modules see it on a CPU-only machine."""

    def __init__(self):
        super().__init__("torch")
        self.cuda = _cuda_namespace()
        for name in _FACTORIES:
            real = getattr(torch, name)
            setattr(self, name, self._cpu_factory(real))

    @staticmethod
    def _cpu_factory(real):
        def factory(*args, **kwargs):
            return real(*args, **_to_cpu_device(kwargs))
        return factory

    def __getattr__(self, name):
        return getattr(torch, name)


class CpuRNGStatesTracker:
    """Megatron's CudaRNGStatesTracker for the CPU generator: named states forked around
    model-parallel regions (dropout inside TP regions draws from a per-TP-rank stream)."""

    def __init__(self):
        self.reset()

    def reset(self):
        self.states_ = {}
        self.seeds_ = set()
        self._is_initialized = False

    def is_initialized(self):
        return self._is_initialized

    def get_states(self):
        return dict(self.states_)

    def set_states(self, states):
        self._is_initialized = True
        self.states_ = dict(states)

    def add(self, name, seed):
        if seed in self.seeds_ or name in self.states_:
            raise ValueError(f"rng state {name!r} or seed {seed} already registered")
        self._is_initialized = True
        self.seeds_.add(seed)
        self.states_[name] = torch.Generator().manual_seed(seed).get_state()

    @contextlib.contextmanager
    def fork(self, name="model-parallel-rng"):
        if name not in self.states_:
            raise KeyError(f"rng state {name!r} was not added; call seed_all() first")
        outer = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(outer)


def _move_to_cpu_as_numpy(tensor, as_numpy=False, record_stream=False):
    """Megatron's maybe_move_tensor_to_cpu only converts CUDA tensors; all-to-all split sizes
    must become numpy arrays on the CPU too."""
    if torch.is_tensor(tensor) and as_numpy:
        return tensor.cpu().numpy()
    return tensor


# Modules whose module-level `torch` is replaced. Listed, not discovered, so that the set of
# Megatron code running under the shim is explicit and reviewable.
_PATCHED_MODULES = (
    "megatron.core.models.common.embeddings.rotary_pos_embedding",
    "megatron.core.models.common.embeddings.language_model_embedding",
    "megatron.core.models.gpt.gpt_model",
    "megatron.core.tensor_parallel.mappings",
    "megatron.core.tensor_parallel.layers",
    "megatron.core.tensor_parallel.random",
    "megatron.core.tensor_parallel.cross_entropy",
    "megatron.core.transformer.attention",
    "megatron.core.transformer.multi_latent_attention",
    "megatron.core.models.common.embeddings.yarn_rotary_pos_embedding",
    "megatron.core.transformer.transformer_layer",
    "megatron.core.transformer.transformer_block",
    "megatron.core.transformer.utils",
    "megatron.core.transformer.moe.router",
    "megatron.core.transformer.moe.experts",
    "megatron.core.transformer.moe.moe_layer",
    "megatron.core.transformer.moe.moe_utils",
    "megatron.core.transformer.moe.token_dispatcher",
    "megatron.core.pipeline_parallel.schedules",
    "megatron.core.pipeline_parallel.p2p_communication",
    "megatron.core.distributed.distributed_data_parallel",
    "megatron.core.distributed.param_and_grad_buffer",
    "megatron.core.distributed.finalize_model_grads",
    "megatron.core.optimizer.optimizer",
    "megatron.core.optimizer.clip_grads",
    "megatron.core.optimizer.distrib_optimizer",
    "megatron.core.optimizer.cpu_offloading.hybrid_optimizer",
    "megatron.core.parallel_state",
    "megatron.core.utils",
    "megatron.core.dist_checkpointing.strategies.torch",
    "megatron.core.dist_checkpointing.strategies.filesystem_async",
    "megatron.core.dist_checkpointing.strategies.state_dict_saver",
    "megatron.core.dist_checkpointing.strategies.fully_parallel",
    "megatron.core.dist_checkpointing.strategies.async_utils",
    "megatron.core.dist_checkpointing.exchange_utils",
)

_INSTALLED = False


def needed() -> bool:
    return not device_choice.on_gpu()


def install() -> None:
    """Install the shims once per process; a no-op where CUDA is available."""
    global _INSTALLED
    if _INSTALLED or not needed():
        return
    proxy = _TorchForMegatron()
    for name in _PATCHED_MODULES:
        module = importlib.import_module(name)
        if getattr(module, "torch", None) is torch:
            module.torch = proxy
    dispatcher = sys.modules["megatron.core.transformer.moe.token_dispatcher"]
    dispatcher.maybe_move_tensor_to_cpu = _move_to_cpu_as_numpy
    for name in ("megatron.core.models.common.embeddings.rope_utils",
                 "megatron.core.models.common.embeddings.rotary_pos_embedding"):
        importlib.import_module(name).get_pos_emb_on_this_cp_rank = _pos_emb_on_this_cp_rank
    mappings = sys.modules["megatron.core.tensor_parallel.mappings"]
    mappings._gather_along_first_dim = _uneven_gather_first_dim(mappings._gather_along_first_dim)
    mappings._reduce_scatter_along_first_dim = _uneven_reduce_scatter_first_dim(
        mappings._reduce_scatter_along_first_dim)
    p2p = sys.modules["megatron.core.pipeline_parallel.p2p_communication"]
    p2p.P2PCommunicator._communicate_shapes = _communicate_shapes_unambiguously
    language_module = importlib.import_module(
        "megatron.core.models.common.language_module.language_module").LanguageModule
    language_module.setup_embeddings_and_output_layer = _keep_on_cpu(
        language_module.setup_embeddings_and_output_layer)
    distrib = importlib.import_module("megatron.core.optimizer.distrib_optimizer").DistributedOptimizer
    distrib._build_model_and_main_param_groups = staticmethod(_types_read_as_cuda(
        distrib._build_model_and_main_param_groups))
    hybrid = importlib.import_module("megatron.core.optimizer.cpu_offloading.hybrid_optimizer")
    hybrid.HybridDeviceOptimizer._get_sub_optimizer_param_groups = _split_as_on_gpu(
        hybrid.HybridDeviceOptimizer._get_sub_optimizer_param_groups)
    optimizer = sys.modules["megatron.core.optimizer.optimizer"]
    optimizer.clip_grad_by_total_norm_fp32 = _types_read_as_cuda(optimizer.clip_grad_by_total_norm_fp32)
    # The plain (not distributed) optimizer of a bf16 model checks its parameters' CUDA type names
    # (scripts/verify_conversion.py --grads on a bf16 checkpoint).
    float16 = optimizer.Float16OptimizerWithFloat16Params
    float16.__init__ = _types_read_as_cuda(float16.__init__)
    random = sys.modules["megatron.core.tensor_parallel.random"]
    random._CUDA_RNG_STATE_TRACKER = CpuRNGStatesTracker()
    random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    # Activation recompute saves the CUDA generator's state beside the CPU generator's and sets
    # both back before recomputing (_get_all_rng_states / _set_all_rng_states). Without CUDA the
    # CPU generator, which those calls save and restore themselves, is the only one.
    random._get_cuda_rng_state = lambda *args, **kwargs: None
    random._set_cuda_rng_state = lambda *args, **kwargs: None
    _INSTALLED = True


def _pos_emb_on_this_cp_rank(pos_emb, seq_dim, cp_group):
    """Megatron's get_pos_emb_on_this_cp_rank without pinned memory and `.cuda()`: rank r keeps
    sequence chunks r and 2*cp-1-r of 2*cp equal chunks (the load-balanced causal split)."""
    cp_size, cp_rank = cp_group.size(), cp_group.rank()
    index = torch.tensor([cp_rank, 2 * cp_size - cp_rank - 1], device=pos_emb.device)
    pos_emb = pos_emb.view(*pos_emb.shape[:seq_dim], 2 * cp_size, -1,
                           *pos_emb.shape[seq_dim + 1:])
    pos_emb = pos_emb.index_select(seq_dim, index)
    return pos_emb.view(*pos_emb.shape[:seq_dim], -1, *pos_emb.shape[seq_dim + 2:])


def _uneven_gather_first_dim(original):
    """Megatron's gather with per-rank split sizes, which gloo cannot do directly."""

    def gather(input_, group, output_split_sizes=None, use_global_buffer=False):
        if output_split_sizes is None or group.size() == 1:
            return original(input_, group, output_split_sizes, use_global_buffer)
        return all_gather_uneven(input_, output_split_sizes, group)

    return gather


def _uneven_reduce_scatter_first_dim(original):
    """Megatron's reduce-scatter with per-rank split sizes, which gloo cannot do directly."""

    def reduce_scatter(input_, group, input_split_sizes=None, use_global_buffer=False):
        if input_split_sizes is None or group.size() == 1:
            return original(input_, group, input_split_sizes, use_global_buffer)
        return reduce_scatter_uneven(input_, input_split_sizes, group)

    return reduce_scatter


def _communicate_shapes_unambiguously(self, tensor_send_next, tensor_send_prev, recv_prev,
                                      recv_next):
    """Megatron batches the shape exchange with batch_isend_irecv; gloo matches messages between
    two ranks in order, so with pp=2 (prev rank == next rank) "from prev" and "from next" can
    swap and the interleaved schedule deadlocks. Route shapes through _p2p_ops, which uses a
    separate communicator per direction for a 2-rank pipeline and an even/odd order otherwise."""
    p2p = sys.modules["megatron.core.pipeline_parallel.p2p_communication"]

    def shape_of(tensor):
        return None if tensor is None else torch.tensor(tensor.size(), dtype=torch.int64)

    recv_prev_shape = torch.empty(3, dtype=torch.int64) if recv_prev else None
    recv_next_shape = torch.empty(3, dtype=torch.int64) if recv_next else None
    reqs = p2p._p2p_ops(
        tensor_send_prev=shape_of(tensor_send_prev), tensor_recv_prev=recv_prev_shape,
        tensor_send_next=shape_of(tensor_send_next), tensor_recv_next=recv_next_shape,
        group=self.pp_group, prev_pipeline_rank=self.prev_rank, next_pipeline_rank=self.next_rank,
    )
    for req in reqs.values():
        req.wait()
    return ([0, 0, 0] if recv_prev_shape is None else recv_prev_shape.tolist(),
            [0, 0, 0] if recv_next_shape is None else recv_next_shape.tolist())


@contextlib.contextmanager
def _tensor_cuda_is_identity():
    original = torch.Tensor.cuda
    torch.Tensor.cuda = lambda self, *args, **kwargs: self
    try:
        yield
    finally:
        torch.Tensor.cuda = original


@contextlib.contextmanager
def _cpu_types_read_as_cuda():
    original = torch.Tensor.type

    def type_name(self, *args, **kwargs):
        name = original(self, *args, **kwargs)
        if args or kwargs or not name.startswith("torch.") or ".cuda." in name:
            return name
        return "torch.cuda." + name[len("torch."):]

    torch.Tensor.type = type_name
    try:
        yield
    finally:
        torch.Tensor.type = original


def _types_read_as_cuda(method):
    """The optimizers sort parameters by `param.type()` and accept only CUDA type names (building
    the distributed optimizer's groups, clipping gradients); a CPU float32 parameter is the same
    kind of tensor, so it reads as one during the call."""

    def wrapper(*args, **kwargs):
        with _cpu_types_read_as_cuda():
            return method(*args, **kwargs)

    return wrapper


def _keep_on_cpu(method):
    """For the few Megatron methods that call `tensor.cuda()` (which a module proxy cannot
    reach): `.cuda()` returns the tensor itself, only for the duration of the call."""

    def wrapper(*args, **kwargs):
        with _tensor_cuda_is_identity():
            return method(*args, **kwargs)

    return wrapper


def _split_as_on_gpu(method):
    """Megatron's optimizer offload (HybridDeviceOptimizer) splits the optimizer's *CUDA*
    parameters: `offload_fraction` of them get a host copy (`.cpu().pin_memory()`) that the host
    AdamW steps and copies back, the rest stay with the device optimizer (with fp32 copies of
    bf16 ones). Without CUDA every tensor reads as a host one and the split finds no device
    parameter. So while it splits, the parameters it was given and what detach/clone/float make
    of them read as device tensors, and `.cpu()` makes a real (unpinned) copy that reads as a
    host one: the same split, copies and steps as on a GPU."""

    def wrapper(self, offload_fraction):
        params = [p for group in self.param_groups for p in group["params"]]
        for p in params:
            p._megarl_on_device = True
        try:
            with _class_attributes(torch.Tensor, is_cuda=property(_reads_on_device),
                                   detach=_same_place("detach"), clone=_same_place("clone"),
                                   float=_same_place("float"),
                                   cpu=lambda t: torch._C.TensorBase.clone(t),
                                   pin_memory=lambda t, *args, **kwargs: t):
                return method(self, offload_fraction)
        finally:
            for p in params:
                del p._megarl_on_device

    return wrapper


def _reads_on_device(tensor) -> bool:
    return getattr(tensor, "_megarl_on_device", False)


def _same_place(name: str):
    """Tensor.<name> whose result reads as a device tensor when its source does."""
    op = getattr(torch._C.TensorBase, name)

    def same_place(tensor, *args, **kwargs):
        out = op(tensor, *args, **kwargs)
        if out is not tensor and _reads_on_device(tensor):
            out._megarl_on_device = True
        return out

    return same_place


@contextlib.contextmanager
def _class_attributes(cls, **attributes):
    """Set attributes on `cls` for the duration of the block (inherited ones: shadowed)."""
    saved = {name: cls.__dict__[name] for name in attributes if name in cls.__dict__}
    for name, value in attributes.items():
        setattr(cls, name, value)
    try:
        yield
    finally:
        for name in attributes:
            if name in saved:
                setattr(cls, name, saved[name])
            else:
                delattr(cls, name)
