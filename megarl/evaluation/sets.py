"""The held-out sets of a run, loaded once at setup: each set's prompts (read, rendered and
filtered as data.* reads the training prompts) and its Scorer (one per distinct reward table;
the training Scorer, with its scoring pool, where a set is scored as training is)."""

import os
from dataclasses import dataclass
from typing import Callable, Dict, List, Tuple

from megarl.evaluation.config import EvalConfig
from megarl.evaluation.eval_metrics import source_names
from megarl.rewards.functions import RewardTable
from megarl.rewards.scorer import Scorer
from megarl.rollout.prompts import Prompt, load_prompts


def load_sets(config: EvalConfig, tokenizer, max_prompt_len: int, overlong: str) -> Dict[str, List[Prompt]]:
    """Each set's prompts: the file's, less those over max_prompt_len (or refused, as `overlong`
    says), the first config.max_prompts of them. A missing or empty file, or a record without its
    fields, is refused naming the set."""
    out = {}
    for name, spec in config.sets.items():
        if not os.path.isfile(spec.path):
            raise FileNotFoundError(f"eval.sets.{name}.path={spec.path!r} does not exist (a .jsonl or "
                                    ".parquet file of held-out prompts)")
        try:
            prompts = load_prompts(spec.path, tokenizer, max_prompt_len, spec.keys, overlong).prompts
            source_names(p.data_source for p in prompts)
        except ValueError as error:
            raise ValueError(f"eval.sets.{name}: {error}") from error
        out[name] = prompts[:config.max_prompts or None]
    return out


@dataclass
class HeldOut:
    """What a run evaluates: `config` with its token budget resolved (planning/resolved.resolved_eval),
    each set's prompts and Scorer."""
    config: EvalConfig
    prompts: Dict[str, List[Prompt]]
    scorers: Dict[str, Scorer]

    @classmethod
    def load(cls, config: EvalConfig, tokenizer, max_prompt_len: int, overlong: str, training: Scorer,
             make_scorer: Callable[[RewardTable], Scorer]) -> "HeldOut":
        """`make_scorer`: a Scorer of a reward table no earlier set (nor training) uses."""
        made: List[Tuple[RewardTable, Scorer]] = [(training.table, training)]
        scorers = {}
        for name, spec in config.sets.items():
            table = spec.reward_table(training.table)
            scorer = next((s for t, s in made if t == table), None)
            if scorer is None:
                scorer = make_scorer(table)
                made.append((table, scorer))
            scorers[name] = scorer
        return cls(config, load_sets(config, tokenizer, max_prompt_len, overlong), scorers)

    def close(self, training: Scorer) -> None:
        """Close the Scorers made for the sets (`training`'s owner closes that one)."""
        for scorer in {id(s): s for s in self.scorers.values() if s is not training}.values():
            scorer.close()
