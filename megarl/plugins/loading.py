"""Resolving a configured name to a callable: a built-in name, 'package.module:function', or
'path/to/file.py:function' (a file outside any package, as verl's custom_reward_function.path
names one; relative to the directory the run starts in). Errors name the value and the choices."""

import importlib
import importlib.util
import os
import sys
from typing import Callable, Dict


def _module(name: str, what: str, value: str):
    if not name.endswith(".py"):
        return importlib.import_module(name)
    path = os.path.abspath(name)
    if not os.path.isfile(path):
        raise ValueError(f"{what} {value!r}: file {path!r} does not exist")
    key = f"megarl_plugin_{abs(hash(path))}"  # one module per file, however often it is named
    if key not in sys.modules:
        spec = importlib.util.spec_from_file_location(key, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        sys.modules[key] = module
    return sys.modules[key]


def load_callable(name: str, builtins: Dict[str, Callable], what: str) -> Callable:
    """builtins[name], or the function `name` = 'module:function' or 'file.py:function' names."""
    if name in builtins:
        return builtins[name]
    if ":" not in name:
        raise ValueError(f"{what} {name!r} is neither built in ({sorted(builtins)}) nor 'module:function' "
                         "or 'path/to/file.py:function'")
    module_name, function_name = name.rsplit(":", 1)
    try:
        function = getattr(_module(module_name, what, name), function_name)
    except (ImportError, AttributeError) as error:
        raise ValueError(f"{what} {name!r}: cannot load {function_name!r} from module "
                         f"{module_name!r} ({error}); is the module on PYTHONPATH?") from error
    if not callable(function):
        raise ValueError(f"{what} {name!r} is not callable")
    return function
