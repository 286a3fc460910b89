"""Tool calls in a model's turn, as its chat format writes them: pure parsers from the decoded
turn to (content, calls, errors).

Built in: `hermes`, the Hermes/Qwen format every Qwen2.5/Qwen3 chat template and verl's default
use: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, several per turn. A custom format
is `generation.agent.parser=module:function`, a function of the turn's text returning a ParsedTurn.
A call whose JSON does not parse, or has no name, is an error the loop answers with a tool message
(the model sees what it got wrong), never an exception.
"""

import json
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional

from megarl.plugins.loading import load_callable


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: Dict[str, Any]


@dataclass(frozen=True)
class ParsedTurn:
    content: str  # the turn's text outside its calls
    calls: List[ToolCall] = field(default_factory=list)
    errors: List[str] = field(default_factory=list)  # one per call that could not be read


_HERMES = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


def _call(text: str) -> ToolCall:
    """One call's JSON: {"name": str, "arguments": object or its JSON text}."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"tool call {text.strip()[:200]!r} is not JSON ({error})") from None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
        raise ValueError(f"tool call {text.strip()[:200]!r} has no \"name\"")
    arguments = value.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError as error:
            raise ValueError(f"tool call {value['name']!r}: arguments {arguments[:200]!r} are not "
                             f"JSON ({error})") from None
    if not isinstance(arguments, dict):
        raise ValueError(f"tool call {value['name']!r}: arguments {arguments!r} are not an object")
    return ToolCall(value["name"], arguments)


def hermes(text: str) -> ParsedTurn:
    calls, errors = [], []
    for match in _HERMES.finditer(text):
        try:
            calls.append(_call(match.group(1)))
        except ValueError as error:
            errors.append(str(error))
    if "<tool_call>" in _HERMES.sub("", text):
        errors.append("a <tool_call> is not closed by </tool_call>")
    return ParsedTurn(_HERMES.sub("", text).strip(), calls, errors)


PARSERS: Dict[str, Callable[[str], ParsedTurn]] = {"hermes": hermes}


def load_parser(name: Optional[str]) -> Callable[[str], ParsedTurn]:
    return load_callable(name or "hermes", PARSERS, "generation.agent.parser")
