"""Resolving a configured name to a callable: a built-in name, or 'package.module:function' for a
user's own (reward functions, sample producers). Errors name the value and the choices."""

import importlib
from typing import Callable, Dict


def load_callable(name: str, builtins: Dict[str, Callable], what: str) -> Callable:
    """builtins[name], or the function `name` = 'module:function' names."""
    if name in builtins:
        return builtins[name]
    if ":" not in name:
        raise ValueError(f"{what} {name!r} is neither built in ({sorted(builtins)}) nor 'module:function'")
    module_name, function_name = name.split(":", 1)
    try:
        function = getattr(importlib.import_module(module_name), function_name)
    except (ImportError, AttributeError) as error:
        raise ValueError(f"{what} {name!r}: cannot load {function_name!r} from module "
                         f"{module_name!r} ({error}); is the module on PYTHONPATH?") from error
    if not callable(function):
        raise ValueError(f"{what} {name!r} is not callable")
    return function
