"""The package's shape, read from the source: rooms only (no modules loose at megarl/), imports
that point down the layers, no import cycles, and Megatron's parallel state touched by its one
adapter only."""

import ast
import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "megarl"

# A package may import from packages on lower layers only (and from itself).
LAYERS = {
    "algos": 0, "batch": 0, "platform": 0, "plugins": 0,
    "parallel_state": 1,
    "models": 2, "rewards": 2,
    "rollout": 3,
    "actor": 4, "evaluation": 4,
    "critic": 5, "resharding": 5, "teacher": 5,
    "checks": 6, "demo": 6, "planning": 6,
    "rollout_ranks": 7,
    "trainer": 8,
}
ADAPTER = PACKAGE / "parallel_state" / "megatron_groups.py"


def _modules():
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        yield name, path, ast.parse(path.read_text())


def _imports(tree):
    """Names of megarl modules imported anywhere in the module, inside functions too: `from
    megarl.x import y` is megarl.x.y when y is a module, else megarl.x."""
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("megarl"):
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                is_module = (PACKAGE.parent / (sub.replace(".", "/") + ".py")).exists() or \
                    (PACKAGE.parent / sub.replace(".", "/") / "__init__.py").exists()
                yield sub if is_module else node.module
        elif isinstance(node, ast.Import):
            yield from (a.name for a in node.names if a.name.startswith("megarl"))


def test_no_modules_loose_at_the_package_root():
    loose = sorted(p.name for p in PACKAGE.glob("*.py") if p.name != "__init__.py")
    assert not loose, f"give these a room (a subpackage): {loose}"
    rooms = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()}
    assert rooms == set(LAYERS), f"packages and layers differ: {rooms ^ set(LAYERS)}"


def test_imports_point_down_the_layers():
    upward = []
    for name, path, tree in _modules():
        parts = name.split(".")
        if len(parts) < 2:
            continue
        for target in _imports(tree):
            room = target.split(".")[1] if target.count(".") else None
            if room in LAYERS and room != parts[1] and LAYERS[room] >= LAYERS[parts[1]]:
                upward.append(f"{path.relative_to(PACKAGE.parent)} imports {target}")
    assert not upward, "imports that point up or sideways:\n" + "\n".join(sorted(set(upward)))


def test_no_import_cycles():
    # Imports inside functions count: deferring one keeps Python from failing at import time,
    # yet the modules on the cycle still depend on each other.
    known = {name for name, _, _ in _modules()}
    graph = {name: {t for t in _imports(tree) if t in known and t != name}
             for name, _, tree in _modules()}
    state = {}

    def visit(node, stack):
        state[node] = "open"
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                raise AssertionError("import cycle: " + " -> ".join(stack[stack.index(nxt):] + [nxt]))
            if nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])


def test_megatron_parallel_state_is_touched_by_the_adapter_only():
    offenders = []
    for _, path, tree in _modules():
        if path == ADAPTER:
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module == "megatron.core" and any(
                    a.name == "parallel_state" for a in node.names):
                offenders.append(str(path.relative_to(PACKAGE.parent)))
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [node.module] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
                if any(n and n.startswith("megatron.core.parallel_state") for n in names):
                    offenders.append(str(path.relative_to(PACKAGE.parent)))
    assert not offenders, f"read parallel state through megarl.parallel_state.megatron_groups: {offenders}"
