"""A generative judge, `judge:CONFIG`: each sample is put to a model behind an OpenAI-compatible
endpoint (`vllm serve`, SGLang, a hosted API) through a prompt template, and the verdict is parsed
to a score.

CONFIG is a YAML or JSON file:
    url: http://127.0.0.1:8000/v1   # the endpoint's base, as OpenAI clients take it
    model: judge                    # the served model name
    template: "Question: {question}\\nAnswer: {response}\\nReference: {ground_truth}\\nScore 0-10:"
    pattern: "(-?\\d+(?:\\.\\d+)?)"    # the verdict's last match; group 1 if it has one
    labels: {}                      # matched text -> score (e.g. {CORRECT: 1, INCORRECT: 0});
                                    # empty: the match is a number
    scale: 1.0                      # score = number (or label's score) x scale
    chat: true                      # /chat/completions with the template as the user turn;
                                    # false: /completions with it as the prompt
    max_tokens: 64
    temperature: 0.0
    request_timeout_s: 60
    api_key_env: ""                 # an environment variable holding the key (never the file)
    log_path: ""                    # a .jsonl every verdict is appended to (empty: none)
The template's fields: {question} (the prompt's last user turn), {response}, {ground_truth},
{data_source}. A verdict that states no score scores 0: each result carries judge_parsed (1 or 0),
so reward/judge_parsed_mean is the share of verdicts that parsed. An endpoint that fails or
times out fails the sample as any reward function's exception does (scored 0, counted).
"""

import json
import os
import re
import time
import urllib.request
from dataclasses import dataclass, field, fields
from typing import Any, Dict, Mapping, Optional

import yaml

FIELDS = ("question", "response", "ground_truth", "data_source")


@dataclass(frozen=True)
class JudgeConfig:
    url: str
    model: str
    template: str
    pattern: str = r"(-?\d+(?:\.\d+)?)"
    labels: Dict[str, float] = field(default_factory=dict)
    scale: float = 1.0
    chat: bool = True
    max_tokens: int = 64
    temperature: float = 0.0
    request_timeout_s: float = 60.0
    api_key_env: str = ""
    log_path: str = ""

    def __post_init__(self):
        try:
            self.template.format(**{name: "" for name in FIELDS})
        except (KeyError, IndexError, ValueError) as error:
            raise ValueError(f"judge template {self.template!r} uses {error}; its fields are {FIELDS} "
                             "(double a literal brace: {{ }})") from None
        re.compile(self.pattern)
        if self.api_key_env and self.api_key_env not in os.environ:
            raise ValueError(f"judge api_key_env={self.api_key_env!r} is not set in the environment")


def verdict_score(text: str, config: JudgeConfig) -> Optional[float]:
    """The score the verdict states, or None when it states none. Pure."""
    matches = list(re.finditer(config.pattern, text))
    if not matches:
        return None
    last = matches[-1]
    said = (last.group(1) if last.re.groups else last.group(0)).strip()
    if config.labels:
        return None if said not in config.labels else float(config.labels[said]) * config.scale
    try:
        return float(said) * config.scale
    except ValueError:
        return None


def question_of(messages) -> str:
    users = [m["content"] for m in messages if m.get("role") == "user"]
    return str(users[-1]) if users else ""


class Judge:
    def __init__(self, config: JudgeConfig, source: str = ""):
        self.config, self.source = config, source

    @classmethod
    def from_file(cls, path: str) -> "Judge":
        if not os.path.isfile(path):
            raise ValueError(f"judge config {path!r} does not exist (judge:CONFIG names a YAML or JSON file)")
        with open(path) as f:
            raw = yaml.safe_load(f) or {}
        known = {f.name for f in fields(JudgeConfig)}
        unknown = sorted(set(raw) - known)
        missing = sorted(n for n in ("url", "model", "template") if n not in raw)
        if unknown or missing:
            raise ValueError(f"judge config {path!r}: unknown keys {unknown}, missing keys {missing}; "
                             f"the keys are {sorted(known)}")
        return cls(JudgeConfig(**raw), path)

    def _ask(self, text: str) -> str:
        c = self.config
        body: Dict[str, Any] = {"model": c.model, "max_tokens": c.max_tokens, "temperature": c.temperature}
        if c.chat:
            body["messages"] = [{"role": "user", "content": text}]
        else:
            body["prompt"] = text
        headers = {"Content-Type": "application/json"}
        if c.api_key_env:
            headers["Authorization"] = f"Bearer {os.environ[c.api_key_env]}"
        url = c.url.rstrip("/") + ("/chat/completions" if c.chat else "/completions")
        request = urllib.request.Request(url, json.dumps(body).encode(), headers)
        with urllib.request.urlopen(request, timeout=c.request_timeout_s) as reply:
            choice = json.load(reply)["choices"][0]
        return choice["message"]["content"] if c.chat else choice["text"]

    def __call__(self, response: str, ground_truth: Any, data_source: str = "",
                 messages=()) -> Mapping[str, float]:
        truth = ground_truth if isinstance(ground_truth, str) else json.dumps(ground_truth)
        asked = self.config.template.format(question=question_of(messages), response=response,
                                            ground_truth=truth, data_source=data_source)
        verdict = self._ask(asked)
        score = verdict_score(verdict, self.config)
        if self.config.log_path:
            line = json.dumps({"time": time.time(), "judge": self.source, "data_source": data_source,
                               "response": response, "verdict": verdict, "score": score})
            with open(self.config.log_path, "a") as f:
                f.write(line + "\n")
        return {"score": 0.0 if score is None else score, "judge_parsed": float(score is not None)}
