"""The import graph follows docs/architecture.md's layers: no cycles, no import of a higher layer.

Every import counts, at module level or inside a function: a deferred import is still a dependency.
"""

from __future__ import annotations

import ast
import collections
import functools
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "src" / "distcomm"

# Higher numbers sit above lower ones; a module may import its own layer and the ones below.
LAYERS = [
    (0, ["tuning", "reduction", "dtypes", "types", "errors", "signatures", "profiling", "work", "buffers",
         "executor", "launcher_env", "flight_recorder", "diagnostics", "stacks"]),
    (1, ["store", "transport"]),
    (2, ["rendezvous", "_algorithms"]),
    (3, ["backends"]),
    (4, ["process_group"]),
    (5, ["world"]),
    (6, ["_api"]),
    (7, ["__init__", "distributed_c10d", "parallel", "optim", "nn", "algorithms", "utils", "torch_backend", "elastic"]),
    (8, ["run", "launch", "_launcher", "multiprocessing", "bench", "demo", "trace"]),
]
LAYER_OF = {name: level for level, names in LAYERS for name in names}

# Compiled modules (C sources beside the Python ones): imports of them are leaves, not the package.
COMPILED = {"distcomm.transport._shm_round", "distcomm.store.tcp._add_trip"}


def modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(["distcomm", *parts])] = path
    return found


@functools.lru_cache(maxsize=None)
def import_graph() -> dict[str, set[str]]:
    mods = modules()
    graph: dict[str, set[str]] = collections.defaultdict(set)
    for name, path in mods.items():
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                submodules = [f"{target}.{a.name}" for a in node.names
                              if f"{target}.{a.name}" in mods or f"{target}.{a.name}" in COMPILED]
                targets = submodules or [target]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                continue
            graph[name].update(t for t in targets if t in mods and t != name)
    return graph


def test_compiled_modules_have_their_source():
    for name in COMPILED:
        assert (PACKAGE.parent / (name.replace(".", "/") + ".c")).exists(), name


def layer(module: str) -> int:
    parts = module.split(".")
    top = parts[1] if len(parts) > 1 else "__init__"
    return LAYER_OF[top]


def test_every_module_has_a_layer():
    missing = sorted({m.split(".")[1] for m in modules() if "." in m and m.split(".")[1] not in LAYER_OF})
    assert not missing, f"modules with no layer in tests/test_layers.py (and docs/architecture.md): {missing}"


def test_no_import_of_a_higher_layer():
    upward = [
        f"{m} (layer {layer(m)}) imports {t} (layer {layer(t)})"
        for m, targets in sorted(import_graph().items())
        for t in sorted(targets)
        if layer(t) > layer(m)
    ]
    assert not upward, "\n".join(upward)


def test_no_import_cycles():
    graph = import_graph()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for module in list(modules()):
        if module not in index:
            visit(module)
    assert not cycles, cycles


def test_the_checker_sees_an_upward_import():
    """The graph is built from real imports: process_group imports backends (downward)."""
    graph = import_graph()
    assert "distcomm.backends.engine" in graph["distcomm.process_group"]
    assert layer("distcomm.process_group") > layer("distcomm.backends.engine")
