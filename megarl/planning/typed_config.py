"""Typed configuration from YAML plus dotted overrides (`actor.optim.lr=1e-6`), for any tree of
frozen dataclasses.

Owns parsing and checking: unknown keys name the allowed ones, values are checked against the
field's type (int, float, bool, str, Optional, Union, Tuple, Dict, nested dataclass) with the key's full path
in the message, and each dataclass's own __post_init__ validation runs as it is built: all before
any process group or engine exists. A key that is a Python keyword (`async`) is the field of that
name with a trailing underscore (`async_`).
Booleans are YAML 1.2's (true/false only): YAML 1.1 also reads on/off/yes/no as booleans, which
turned `actor.router_replay=off` into False. Those words stay strings, and a bool field accepts
them as a person means them.
Does not own what the fields mean (each dataclass does).
"""

import dataclasses
import keyword
import re
import typing
from typing import Any, Dict, List, Type, TypeVar

import yaml

T = TypeVar("T")

_BOOL_TAG = "tag:yaml.org,2002:bool"
_BOOL_WORDS = {"true": True, "on": True, "yes": True, "false": False, "off": False, "no": False}


class _Loader(yaml.SafeLoader):
    """SafeLoader whose only booleans are true/false (any case), as in YAML 1.2."""


_Loader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag != _BOOL_TAG]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}
_Loader.add_implicit_resolver(_BOOL_TAG, re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"),
                              list("tTfF"))


def parse_yaml(text) -> Any:
    """YAML text or stream -> Python values, with YAML 1.2 booleans (see the module docstring)."""
    return yaml.load(text, Loader=_Loader)


def _set_dotted(tree: Dict[str, Any], dotted: str) -> None:
    if "=" not in dotted:
        raise ValueError(f"override {dotted!r} must look like key.sub=value")
    key, raw = dotted.split("=", 1)
    *parents, leaf = key.strip().split(".")
    node = tree
    for part in parents:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ValueError(f"override {dotted!r}: {part!r} is a value, not a section")
    node[leaf] = parse_yaml(raw)


def _same_shape(value: Any, kind: Any) -> bool:
    """Whether `value` is the container `kind` is (a mapping for a dict or a section, a list for a
    list or tuple): a Union's error then comes from that kind, naming what inside it is wrong."""
    origin = typing.get_origin(kind)
    if isinstance(value, dict):
        return origin is dict or dataclasses.is_dataclass(kind)
    return isinstance(value, (list, tuple)) and origin in (list, tuple)


def _coerce(value: Any, kind: Any, path: str) -> Any:
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if origin is typing.Union:
        if value is None and type(None) in args:
            return None
        kinds = [a for a in args if a is not type(None)]
        if len(kinds) == 1:
            return _coerce(value, kinds[0], path)
        shaped = None  # the error of the kind whose shape the value has (a mapping, a list): its own
        for inner in kinds:  # the first that takes it: Union[bool, str] reads off as False, auto as 'auto'
            try:
                return _coerce(value, inner, path)
            except ValueError as error:
                if shaped is None and _same_shape(value, inner):
                    shaped = error
        if shaped is not None:
            raise shaped
        names = " or ".join(getattr(k, "__name__", str(k)) for k in kinds)
        raise ValueError(f"{path} must be {names}, got {value!r} ({type(value).__name__})")
    if dataclasses.is_dataclass(kind):
        if not isinstance(value, dict):
            raise ValueError(f"{path} must be a section (mapping), got {value!r}")
        return build(kind, value, path)
    if origin is dict:
        if not isinstance(value, dict):
            raise ValueError(f"{path} must be a mapping, got {value!r}")
        key_kind, value_kind = args
        return {_coerce(k, key_kind, f"{path} key"): _coerce(v, value_kind, f"{path}.{k}")
                for k, v in value.items()}
    if origin in (tuple, list):
        if not isinstance(value, (list, tuple)):
            raise ValueError(f"{path} must be a list, got {value!r}")
        inner = args[0] if args else Any
        items = [_coerce(v, inner, f"{path}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if kind is float and isinstance(value, str):
        try:  # YAML 1.1 reads 1e-5 (no dot) as a string
            return float(value)
        except ValueError:
            raise ValueError(f"{path} must be a number, got {value!r}") from None
    if kind is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if kind is bool and isinstance(value, str) and value.lower() in _BOOL_WORDS:
        return _BOOL_WORDS[value.lower()]
    if kind in (int, str, bool) and type(value) is not kind:
        raise ValueError(f"{path} must be {kind.__name__}, got {value!r} ({type(value).__name__})")
    return value


def build(cls: Type[T], values: Dict[str, Any], path: str = "") -> T:
    """cls(**values) with every key and value checked; nested sections built recursively."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    values = {f"{key}_" if keyword.iskeyword(key) else key: value for key, value in values.items()}
    unknown = sorted(set(values) - set(fields))
    if unknown:
        where = path or "the top level"
        raise ValueError(f"unknown key(s) {unknown} in {where}; allowed: {sorted(fields)}")
    missing = sorted(name for name, f in fields.items() if name not in values
                     and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING)
    if missing:
        raise ValueError(f"missing required key(s) {missing} in {path or 'the top level'}")
    hints = typing.get_type_hints(cls)
    kwargs = {name: _coerce(value, hints[name], f"{path}.{name}" if path else name)
              for name, value in values.items()}
    try:
        return cls(**kwargs)
    except (ValueError, TypeError) as error:
        raise ValueError(f"{path or cls.__name__}: {error}") from error


def load(cls: Type[T], yaml_path: str = None, overrides: List[str] = ()) -> T:
    tree: Dict[str, Any] = {}
    if yaml_path:
        with open(yaml_path) as f:
            tree = parse_yaml(f) or {}
    for dotted in overrides:
        _set_dotted(tree, dotted)
    return build(cls, tree)
