"""Tools an agent may call: built-ins (`calculator`, `python`) or `module:function` (also
`path/to/file.py:function`), each with the JSON schema handed to the chat template.

A tool is a function of keyword arguments returning text (anything else is sent as its JSON). Its
schema is the function's `schema` attribute (an OpenAI function schema:
{"name", "description", "parameters": {...}}) or, without one, read from its signature (str, int,
float and bool parameters; those without a default required) and the first line of its docstring.
Tools run in worker processes (tool_worker.py) with a timeout; their failures become tool messages
(rollout/agent/loop.py).
"""

import ast
import inspect
import json
import operator
import os
import resource
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from typing import Any, Callable, Dict, Tuple

from megarl.plugins.loading import load_callable
from megarl.plugins.worker_pool import Loaded

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

SANDBOX_LIMITS = {"cpu_s": 10, "memory_bytes": 1 << 30, "file_bytes": 16 << 20, "output_bytes": 1 << 20}


def _limit():
    resource.setrlimit(resource.RLIMIT_CPU, (SANDBOX_LIMITS["cpu_s"],) * 2)
    resource.setrlimit(resource.RLIMIT_AS, (SANDBOX_LIMITS["memory_bytes"],) * 2)
    resource.setrlimit(resource.RLIMIT_FSIZE, (SANDBOX_LIMITS["file_bytes"],) * 2)


def python(code: str) -> str:
    """Run Python code in a sandbox (no network, limited CPU, memory and files) and return what it
    printed."""
    # unshare -rn: a network namespace of its own (nothing but a down loopback), as an unprivileged
    # user may make one; -I: no user site, no PYTHON* environment; a fresh temporary directory.
    with tempfile.TemporaryDirectory() as workdir:
        proc = subprocess.run(["unshare", "-rn", sys.executable, "-I", "-c", code], cwd=workdir,
                              env={"PATH": os.defpath, "HOME": workdir}, stdin=subprocess.DEVNULL,
                              capture_output=True, preexec_fn=_limit, timeout=SANDBOX_LIMITS["cpu_s"] * 3)
    limit = SANDBOX_LIMITS["output_bytes"]
    out = (proc.stdout[:limit] + proc.stderr[:limit]).decode(errors="replace")
    return out if proc.returncode == 0 else f"{out}\n(exit code {proc.returncode})"


python.schema = {
    "name": "python", "description": "Run Python code in a sandbox and return what it printed.",
    "parameters": {"type": "object", "required": ["code"], "properties": {
        "code": {"type": "string", "description": "a Python program; print the result"}}},
}

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


@dataclass(frozen=True)
class Tool:
    key: str  # as configured: a built-in name or module:function
    schema: Dict[str, Any]

    @property
    def name(self) -> str:
        """What the model calls it."""
        return self.schema["name"]


def load_tool(key: str) -> Tuple[Tool, Callable]:
    fn = load_callable(key, BUILTIN, "tool")
    if fn is python:
        check_sandbox()
    return Tool(key, schema_of(key, fn)), fn


def check_sandbox() -> None:
    probe = subprocess.run(["unshare", "-rn", "true"], capture_output=True)
    if probe.returncode:
        raise RuntimeError("the python tool's sandbox needs `unshare -rn` (a network namespace of its "
                           f"own) and this machine refuses it: {probe.stderr.decode().strip()}; enable "
                           "unprivileged user namespaces (sysctl kernel.unprivileged_userns_clone=1) "
                           "or drop the python tool")


def as_text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value)


def _apply(function: Callable, payload: Tuple[str, Any]) -> Any:
    """("tool", arguments) -> the tool's text; ("interaction", (messages, kwargs)) -> what the
    interaction returned."""
    kind, arguments = payload
    if kind == "tool":
        return as_text(function(**arguments))
    messages, kwargs = arguments
    return function(messages, **kwargs)


def loaded_tools() -> Loaded:
    """The tool worker's Caller: tools and interactions by configured key, loaded once."""
    return Loaded(lambda key: load_callable(key, BUILTIN, "tool or interaction"), _apply)
