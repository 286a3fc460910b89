"""One evaluation of held-out sets with a rollout engine's current weights: sample each set's
prompts, score the samples with the set's Scorer, and aggregate (eval_metrics.py).

Used by the training loop (between steps, inside the colocated memory handoff: trainer/
rollout_source.py) and by a standalone evaluator over a world of one; both give the same numbers
for the same weights and seed, since a set's sampling seed depends on the run's seed and the set's
name only, never on the step.
"""

import zlib
from typing import Dict, List, Mapping, Sequence

from megarl.evaluation.config import EvalConfig
from megarl.evaluation.eval_metrics import EvalRow, aggregate
from megarl.rewards.scorer import Scorer
from megarl.rollout.collect import all_samples, scored
from megarl.rollout.engine import RolloutSample, SamplingConfig
from megarl.rollout.producer import SampleProducer
from megarl.rollout.prompts import Prompt
from megarl.rollout.turns import TurnDriver


def set_sampling(config: EvalConfig, name: str, seed: int, eos_token_id: int) -> SamplingConfig:
    """How set `name` is sampled: its seed is fixed by the run's seed and the set's name (crc32:
    Python's hash of a string differs between processes)."""
    if config.max_new_tokens < 1:
        raise ValueError(f"eval.max_new_tokens={config.max_new_tokens}: resolve 0 to the generation "
                         "budget first (planning/resolved.resolved_eval) or give a budget >= 1")
    return SamplingConfig(n=config.samples, temperature=config.temperature, top_p=config.top_p,
                          max_new_tokens=config.max_new_tokens, stop_token_ids=(eos_token_id,),
                          seed=seed + zlib.crc32(name.encode()))


def evaluate(driver: TurnDriver, producer: SampleProducer, prompts_by_set: Mapping[str, Sequence[Prompt]],
             config: EvalConfig, tokenizer, scorers: Mapping[str, Scorer], seed: int) -> Dict[str, float]:
    """{`eval/<set>/<source>/<metric>`: value} of every set in `prompts_by_set` (set name -> its
    prompts), each scored by `scorers[set name]`.

    `driver`: drives this rank's engine, awake and holding the weights to evaluate (a VLLMEngine,
    or any StreamingEngine);
    `producer`: how samples are made (rollout/producer.load_producer); `config`: samples,
    temperature, top_p, pass_k, threshold and max_new_tokens (>= 1: planning/resolved.resolved_eval resolves
    0) are read, not its sets; `tokenizer`: the policy's (decodes responses, gives the stop token);
    `seed`: the run's seed. Collective over the default process group (a standalone evaluator
    starts a gloo world of one): every rank returns the same metrics."""
    rows: List[EvalRow] = []
    for name, prompts in prompts_by_set.items():
        sampling = set_sampling(config, name, seed, tokenizer.eos_token_id)
        samples = all_samples(driver, producer, list(prompts), sampling)
        rows += scored_rows(name, prompts, samples, tokenizer, scorers[name])
    return aggregate(rows, config.pass_k, config.threshold)


def scored_rows(name: str, prompts: Sequence[Prompt], samples: Sequence[RolloutSample], tokenizer,
                scorer: Scorer) -> List[EvalRow]:
    """Set `name`'s samples (of `prompts`, by prompt_index) scored by `scorer`, as EvalRows: also
    how rollout ranks of their own score their evaluations (rollout_ranks/evaluation.py).
    Collective (the Scorer's)."""
    rewards = scored(list(samples), list(prompts), tokenizer, scorer).batch.rewards.tolist()
    return [EvalRow(name, prompts[s.prompt_index].data_source, s.prompt_index, reward,
                    len(s.response_ids), s.finish_reason == "length")
            for s, reward in zip(samples, rewards)]
