"""The one builder of a run's rollout side: the tokenizer, the training prompts, the vLLM engine
and the SampleProducer, made from the same settings and in the same order for colocated engines
(trainer/loop.py's setup) and for rollout ranks of their own (rollout_ranks/server.py's serve);
and the one call that loads the training prompts, which preflight checks with.

Owns what the rollout side is made of and from which settings. Does not own when it is built (a
colocated one before any model, its engine then put to sleep by setup), the engine
(rollout/vllm/engine.py), the producers (producer.py) or the prompt format (prompts.py).
"""

from dataclasses import dataclass
from typing import Any

from megarl.rollout.config import DataConfig, EngineSpec, GenerationConfig
from megarl.rollout.producer import SampleProducer, load_producer
from megarl.rollout.prompts import PromptSet, load_prompts
from megarl.rollout.vllm.engine import VLLMEngine


@dataclass(frozen=True)
class RolloutSide:
    tokenizer: Any  # the policy's HF tokenizer
    prompts: PromptSet  # data.path's (load_training_prompts)
    engine: VLLMEngine  # awake, with dummy weights until the first sync
    producer: SampleProducer  # generation.producer's


def load_training_prompts(data: DataConfig, tokenizer) -> PromptSet:
    """data.path's prompts, as every rank of a run and the preflight load them."""
    return load_prompts(data.path, tokenizer, data.max_prompt_len, data.keys, data.overlong_prompts)


def build_rollout_side(spec: EngineSpec, data: DataConfig, generation: GenerationConfig,
                       sync_first_rank: int = 0) -> RolloutSide:
    """This rank's rollout side: an engine of spec.rollout_tp ranks whose context holds
    data.max_prompt_len + generation.max_new_tokens tokens. `sync_first_rank`: the engine
    world's rank 0 in the weight sync's ranks (the first rollout rank on a trainer-rollout
    bridge; 0 colocated). Collective over the engines' ranks."""
    import transformers  # slow to import: only where a run starts

    tokenizer = transformers.AutoTokenizer.from_pretrained(spec.hf_dir)
    # The prompts before the engine: a bad file is refused before vLLM's slow start.
    prompts = load_training_prompts(data, tokenizer)
    engine = VLLMEngine(spec.hf_dir, rollout_tp=spec.rollout_tp, rollout_ep=spec.rollout_ep, seed=spec.seed,
                        dtype=spec.dtype, kv_cache_gib=generation.kv_cache_gib,
                        gpu_memory_utilization=generation.gpu_memory_utilization,
                        max_model_len=data.max_prompt_len + generation.max_new_tokens,
                        return_routing=spec.return_routing, router_fp32=spec.router_fp32,
                        sync_first_rank=sync_first_rank, adapters=spec.adapters,
                        quantization=spec.quantization)
    producer = load_producer(generation.producer, tokenizer, generation.agent)
    return RolloutSide(tokenizer, prompts, engine, producer)
