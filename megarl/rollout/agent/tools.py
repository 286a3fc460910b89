"""Tools an agent may call: built-ins (`calculator`, `python`) or `module:function` (also
`path/to/file.py:function`), each with the JSON schema handed to the chat template.

A tool is a function of keyword arguments returning text (anything else is sent as its JSON). Its
schema is the function's `schema` attribute (an OpenAI function schema:
{"name", "description", "parameters": {...}}) or, without one, read from its signature (str, int,
float and bool parameters; those without a default required) and the first line of its docstring.
Tools run in worker processes (tool_worker.py) with a timeout; their failures become tool messages
(rollout/agent/loop.py).

A tool that runs code the model wrote declares it (`fn.runs_code = True`, as the built-in `python`
does) and takes a `sandbox` keyword (left out of its schema): the run's CodeSandbox, whose
`run(code)` runs a Python program in the local sandbox (sandbox.py) or on a SandboxFusion server
(sandbox_http.py), as `generation.agent.sandbox` says, and returns a Ran (its `text(limits)` is
what the built-in answers). The model cannot set that argument.
"""

import ast
import inspect
import json
import operator
from dataclasses import dataclass
from typing import Any, Callable, Dict, Tuple

from megarl.plugins.loading import load_callable
from megarl.plugins.worker_pool import Loaded
from megarl.rollout.agent.sandbox import LIMITS, Limits, Ran, check_local, run_local
from megarl.rollout.agent.sandbox_http import run_http

_JSON_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean"}

_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
              ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
              ast.Pow: operator.pow, ast.USub: operator.neg, ast.UAdd: operator.pos}
_MAX_EXPONENT = 64  # 10**64 is plenty; 9**9**9 would hold the worker for minutes


def _evaluate(node: ast.AST):
    if isinstance(node, ast.Expression):
        return _evaluate(node.body)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPERATORS:
        return _OPERATORS[type(node.op)](_evaluate(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > _MAX_EXPONENT:
            raise ValueError(f"exponent {right} is larger than {_MAX_EXPONENT}")
        return _OPERATORS[type(node.op)](left, right)
    raise ValueError(f"{ast.unparse(node)!r} is not arithmetic (numbers, + - * / // % ** and parentheses)")


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression (numbers, + - * / // % ** and parentheses)."""
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise ValueError(f"{expression!r} is not an expression") from None
    value = _evaluate(tree)
    return str(int(value) if isinstance(value, float) and value.is_integer() else value)


calculator.schema = {
    "name": "calculator", "description": "Evaluate an arithmetic expression exactly.",
    "parameters": {"type": "object", "required": ["expression"], "properties": {
        "expression": {"type": "string", "description": "e.g. (12 + 7) * 3"}}},
}

SANDBOXES = ("local", "http")


@dataclass(frozen=True)
class CodeSandbox:
    """Where tools that run code run it (generation.agent.sandbox): `local`, bubblewrap on the
    machine of the tool's worker (sandbox.py), or `http`, a SandboxFusion run_code endpoint
    (sandbox_http.py), each request within `timeout_s` and retried `retries` times."""
    kind: str = "local"
    url: str = ""
    timeout_s: float = 30.0
    retries: int = 1
    limits: Limits = LIMITS

    def run(self, code: str) -> Ran:
        if self.kind == "http":
            return run_http(code, self.url, self.timeout_s, self.retries, self.limits)
        return run_local(code, self.limits)

    def check(self) -> None:
        """Refuse (RuntimeError naming what is missing and the fix) a machine where the local
        sandbox cannot work; the remote one is checked by its first call."""
        if self.kind == "local":
            check_local()


LOCAL = CodeSandbox()


def python(code: str, sandbox: CodeSandbox = LOCAL) -> str:
    """Run Python code in a sandbox (the standard library only; no network, no files but its own
    temporary folder, no other process; limited threads, CPU, memory and disk) and return what it
    printed."""
    return sandbox.run(code).text(sandbox.limits)


python.schema = {
    "name": "python", "description": "Run Python code (the standard library only) in a sandbox and return "
                                      "what it printed.",
    "parameters": {"type": "object", "required": ["code"], "properties": {
        "code": {"type": "string", "description": "a Python program; print the result"}}},
}
python.runs_code = True

BUILTIN: Dict[str, Callable] = {"calculator": calculator, "python": python}


def schema_of(name: str, fn: Callable) -> Dict[str, Any]:
    """The function's OpenAI schema: its `schema` attribute, or read from its signature."""
    given = getattr(fn, "schema", None)
    if given is not None:
        if not isinstance(given, dict) or not isinstance(given.get("name"), str) or "parameters" not in given:
            raise ValueError(f"tool {name!r}: its schema {given!r} is not {{'name', 'description', "
                             "'parameters'}")
        return given
    properties, required = {}, []
    for parameter in inspect.signature(fn).parameters.values():
        if parameter.name == "sandbox" and runs_code(fn):
            continue  # the run's, never the model's
        kind = _JSON_TYPES.get(parameter.annotation)
        if kind is None or parameter.kind not in (parameter.POSITIONAL_OR_KEYWORD, parameter.KEYWORD_ONLY):
            raise ValueError(f"tool {name!r}: parameter {parameter.name!r} is not a str, int, float or "
                             "bool keyword; give the function a `schema` attribute instead")
        properties[parameter.name] = {"type": kind}
        if parameter.default is inspect.Parameter.empty:
            required.append(parameter.name)
    doc = (inspect.getdoc(fn) or "").strip().split("\n")[0]
    return {"name": fn.__name__, "description": doc,
            "parameters": {"type": "object", "properties": properties, "required": required}}


def runs_code(fn: Callable) -> bool:
    """Whether the tool runs code the model wrote (and so takes the run's sandbox)."""
    return getattr(fn, "runs_code", False) is True


@dataclass(frozen=True)
class Tool:
    key: str  # as configured: a built-in name or module:function
    schema: Dict[str, Any]
    runs_code: bool = False

    @property
    def name(self) -> str:
        """What the model calls it."""
        return self.schema["name"]


def load_tool(key: str) -> Tuple[Tool, Callable]:
    fn = load_callable(key, BUILTIN, "tool")
    return Tool(key, schema_of(key, fn), runs_code(fn)), fn


def as_text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value)


def _apply(function: Callable, payload: Tuple[str, Any]) -> Any:
    """("tool", (arguments, CodeSandbox)) -> the tool's text, the sandbox handed to a tool that
    runs code (over any the model gave); ("interaction", (messages, kwargs)) -> what the
    interaction returned."""
    kind, arguments = payload
    if kind == "tool":
        arguments, sandbox = arguments
        if runs_code(function):
            arguments = {**arguments, "sandbox": sandbox}
        return as_text(function(**arguments))
    messages, kwargs = arguments
    return function(messages, **kwargs)


def loaded_tools() -> Loaded:
    """The tool worker's Caller: tools and interactions by configured key, loaded once."""
    return Loaded(lambda key: load_callable(key, BUILTIN, "tool or interaction"), _apply)
