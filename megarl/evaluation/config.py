"""The `eval` section of a run's config: which held-out sets are evaluated, when, and how they are
sampled and scored. Validated as it is built (typed_config), before any process starts."""

import os
import re
from dataclasses import dataclass, field
from typing import Dict, Optional, Sequence, Tuple, Union

from megarl.rewards.functions import RewardTable
from megarl.rewards.spec import parse_spec
from megarl.rollout.prompts import RecordKeys

_SET_NAME = re.compile(r"^[\w.\-]+$")  # a part of a metric's name: eval/<set>/...


@dataclass(frozen=True)
class EvalSetConfig:
    """One held-out set: `eval.sets.<name>.*`."""
    path: str = ""  # .jsonl or .parquet, read as data.path is (verl's parquet included)
    # The set's reward, spelled as algo.reward / algo.reward_by_source; neither given: the run's
    # training reward. One given: the set's table is exactly what it names (reward defaulting to
    # algo.reward).
    reward: Optional[str] = None
    reward_by_source: Dict[str, str] = field(default_factory=dict)
    # Key paths in each record, as data.* spells them.
    prompt_key: str = "prompt"
    answer_key: str = "auto"
    data_source_key: str = "data_source"
    extra_info_key: str = "extra_info"

    def __post_init__(self):
        if not self.path:
            raise ValueError("path is required (a .jsonl or .parquet file of held-out prompts)")
        if self.reward is not None:
            parse_spec(self.reward, "reward")
        for source, text in self.reward_by_source.items():
            parse_spec(text, f"reward_by_source[{source!r}]")

    @property
    def keys(self) -> RecordKeys:
        return RecordKeys(self.prompt_key, self.answer_key, self.data_source_key, self.extra_info_key)

    def reward_table(self, training: RewardTable) -> RewardTable:
        if self.reward is None and not self.reward_by_source:
            return training
        return RewardTable(self.reward or training.default, self.reward_by_source)


@dataclass(frozen=True)
class EvalConfig:
    """Held-out evaluation (megarl/evaluation): the sets, keyed by name (`eval.sets.heldout.path=
    ...`), or a list of files each named after its file (as verl's val_files), evaluated with the
    rollout engine's current weights before the first step, every `every` steps and after the last
    step."""
    sets: Union[Dict[str, EvalSetConfig], Tuple[str, ...]] = field(default_factory=dict)
    every: int = 0  # evaluate after every N-th step (0: only at the start and after the last step)
    at_start: bool = True  # evaluate the initial weights (step 0) before a fresh run's first step
    samples: int = 1  # samples per prompt (n of pass@k)
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    max_prompts: int = 0  # each set's first N prompts (0: all)
    pass_k: Tuple[int, ...] = (1,)  # pass@k for each k (each <= samples)
    threshold: float = 0.5  # a sample is correct (accuracy, pass@k) when its reward exceeds this
    max_new_tokens: int = 0  # 0: generation.max_new_tokens (the engine is sized for it: not above)

    def __post_init__(self):
        if not isinstance(self.sets, dict):
            object.__setattr__(self, "sets", {name: EvalSetConfig(path=path)
                                              for name, path in set_names(self.sets).items()})
        for name in self.sets:
            if not _SET_NAME.match(name):
                raise ValueError(f"eval.sets key {name!r}: a set's name is part of its metrics' names "
                                 "(eval/<set>/...); use letters, digits, '_', '-' and '.'")
        if self.every < 0 or self.max_prompts < 0 or self.max_new_tokens < 0:
            raise ValueError(f"eval.every={self.every}, eval.max_prompts={self.max_prompts} and "
                             f"eval.max_new_tokens={self.max_new_tokens} must be >= 0 (0: after the last "
                             "step only; all prompts; generation.max_new_tokens)")
        if self.samples < 1:
            raise ValueError(f"eval.samples={self.samples} must be >= 1 (samples per prompt)")
        if self.temperature < 0 or not 0 < self.top_p <= 1:
            raise ValueError(f"eval.temperature={self.temperature} must be >= 0 (0: greedy) and "
                             f"eval.top_p={self.top_p} in (0, 1]")
        if self.temperature == 0 and self.samples > 1:
            raise ValueError(f"eval.samples={self.samples} at eval.temperature=0: greedy samples of a "
                             "prompt are all the same (vLLM refuses them); sample (eval.temperature=0.6, "
                             "say) for pass@k, or set eval.samples=1")
        if not self.pass_k:
            raise ValueError("eval.pass_k is empty; give at least one k, e.g. [1]")
        too_large = [k for k in self.pass_k if not 1 <= k <= self.samples]
        if too_large:
            raise ValueError(f"eval.pass_k={list(self.pass_k)} holds {too_large}, outside [1, eval.samples="
                             f"{self.samples}]: pass@k needs k of a prompt's samples; raise eval.samples "
                             "or drop those k")

    def due_after(self, step: int, last_step: int) -> bool:
        """Whether the weights after `step` are evaluated: every `every` steps and after the last."""
        return bool(self.sets) and (step == last_step or bool(self.every) and step % self.every == 0)


def set_names(paths: Sequence[str]) -> Dict[str, str]:
    """{name: path} of held-out files given as a list: each named after its file (test.jsonl ->
    test); files of one name told apart by their folder (gsm8k/test.parquet -> gsm8k-test)."""
    stem = {path: os.path.splitext(os.path.basename(path))[0] for path in paths}
    shared = {s for s in stem.values() if list(stem.values()).count(s) > 1}
    named = {}
    for path in paths:
        name = stem[path] if stem[path] not in shared else \
            f"{os.path.basename(os.path.dirname(os.path.abspath(path)))}-{stem[path]}"
        if name in named:
            raise ValueError(f"eval.sets lists {named[name]!r} and {path!r}, both named {name!r}; give the "
                             "sets as a mapping with names of your own (eval.sets.NAME.path=FILE)")
        named[name] = path
    return named
