"""From scored held-out samples to the metrics people compare, per set and per data source:
mean reward, accuracy (reward > threshold), pass@k, mean response length and truncation rate,
named `eval/<set>/<source>/<metric>` (`<source>` `all`: the whole set). Pure.

accuracy is the mean over samples; pass@k is each prompt's estimate from its n samples (pass_at_k),
averaged over prompts, as NeMo-RL and the Codex paper report it. A source named "" (records
without one) is `default`; characters TensorBoard would rewrite in a tag (a slash inside a source
name: `openai/gsm8k`) become `_`, so the metric's name is the same in metrics.jsonl and in
TensorBoard.
"""

import re
from collections import defaultdict
from dataclasses import dataclass
from typing import Dict, Iterable, List, Mapping, Sequence

from megarl.evaluation.pass_at_k import pass_at_k

ALL = "all"  # the metrics of a whole set
DEFAULT_SOURCE = "default"  # records without a data source
_UNSAFE = re.compile(r"[^\w.\-]")


@dataclass(frozen=True)
class EvalRow:
    """One scored sample of a held-out prompt."""
    set: str
    data_source: str  # as the record holds it ("" where it holds none)
    prompt_index: int  # the prompt's place in its set: a prompt's samples share it
    reward: float
    response_tokens: int
    truncated: bool  # cut at the token budget


def source_names(sources: Iterable[str]) -> Dict[str, str]:
    """Each data source's name in metric names; refused where two sources would share one, or one
    would be read as the whole set's `all`."""
    names: Dict[str, str] = {}
    for source in sorted(set(sources)):
        name = _UNSAFE.sub("_", source) if source else DEFAULT_SOURCE
        clash = [other for other, given in names.items() if given == name]
        if name == ALL or clash:
            raise ValueError(f"data sources {[*clash, source]!r} would be reported under one name "
                             f"{name!r}{' (the whole set)' if name == ALL else ''}; rename one in the "
                             "records (or point the set's data_source_key at another field)")
        names[source] = name
    return names


def _group_metrics(rows: Sequence[EvalRow], pass_k: Sequence[int], threshold: float) -> Dict[str, float]:
    count = len(rows)
    by_prompt: Dict[int, List[bool]] = defaultdict(list)
    for row in rows:
        by_prompt[row.prompt_index].append(row.reward > threshold)
    metrics = {"reward_mean": sum(r.reward for r in rows) / count,
               "accuracy": sum(r.reward > threshold for r in rows) / count}
    for k in pass_k:
        metrics[f"pass@{k}"] = (sum(pass_at_k(len(c), sum(c), k) for c in by_prompt.values())
                                / len(by_prompt))
    metrics["response_len_mean"] = sum(r.response_tokens for r in rows) / count
    metrics["truncation_rate"] = sum(r.truncated for r in rows) / count
    return metrics


def aggregate(rows: Sequence[EvalRow], pass_k: Sequence[int], threshold: float) -> Dict[str, float]:
    """{`eval/<set>/<source>/<metric>`: value} of every set and data source the rows hold, and of
    each whole set (`all`)."""
    by_set: Dict[str, List[EvalRow]] = defaultdict(list)
    for row in rows:
        by_set[row.set].append(row)
    out: Dict[str, float] = {}
    for name, set_rows in by_set.items():
        names = source_names(r.data_source for r in set_rows)
        groups: Dict[str, List[EvalRow]] = defaultdict(list)
        for row in set_rows:
            groups[names[row.data_source]].append(row)
        groups[ALL] = set_rows
        for group, group_rows in groups.items():
            for metric, value in _group_metrics(group_rows, pass_k, threshold).items():
                out[f"eval/{name}/{group}/{metric}"] = value
    return out


def summary(metrics: Mapping[str, float], step: int) -> List[str]:
    """One console line per set of an evaluation's metrics: its whole-set accuracy and pass@k."""
    lines = []
    for name in sorted({key.split("/")[1] for key in metrics if key.startswith("eval/")}):
        prefix = f"eval/{name}/{ALL}/"
        passes = [f"{key[len(prefix):]} {value:.3f}" for key, value in metrics.items()
                  if key.startswith(prefix + "pass@")]
        lines.append(f"megarl: held-out {name}: accuracy {metrics[prefix + 'accuracy']:.3f}, "
                     f"{', '.join(passes)}, mean reward {metrics[prefix + 'reward_mean']:.3f} "
                     f"(step {step})")
    return lines
