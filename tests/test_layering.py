"""The package reads bottom-up, as the data flows: no module imports from a floor above its own, and
no import cycle exists, counting imports inside functions too (the layers: ``cbteach/core/__init__.py``)."""
from __future__ import annotations

import ast
import pathlib

import cbteach

ROOT = pathlib.Path(cbteach.__file__).parent
# Which floor each subpackage (or top-level module) of cbteach stands on.
FLOORS = {
    "attention": 1, "perf": 1, "models": 1, "bierce": 1, "errors": 1, "argtypes": 1,
    "core": 2,
    "kv": 3,
    "parallel": 4,  # process groups, shards, pipes: what tensor parallelism needs besides the worker
    "worker": 5,  # vLLM V1's v1/worker: the model runner, its persistent batch, a rank
    "executor": 6,  # vLLM V1's v1/executor: one worker in this process, or N worker processes
    "engine": 7,  # the scheduler and the engine core
    "serving": 8, "sim": 8,
    "bench": 9, "viz": 9,
    "exercises": 10, "demo": 10, "preflight": 10, "student": 10, "tournament": 10, "__main__": 11, "": 11,
}


def module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def imports(path: pathlib.Path) -> set[str]:
    """Every cbteach module ``path`` imports (``from . import x`` counts as the module ``x``)."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("cbteach")}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if not target.startswith("cbteach"):
                continue
            for alias in node.names:  # "from .core import modelinfo" imports the module cbteach.core.modelinfo
                sub = f"{target}.{alias.name}"
                found.add(sub if (ROOT.parent / sub.replace(".", "/")).with_suffix(".py").exists()
                          or (ROOT.parent / sub.replace(".", "/")).is_dir() else target)
    return found - {name}


def floor(module: str) -> int:
    parts = module.split(".")
    return FLOORS[parts[1] if len(parts) > 1 else ""]


GRAPH = {module_name(p): imports(p) for p in ROOT.rglob("*.py")}


def test_every_subpackage_has_a_floor():
    assert {m.split(".")[1] for m in GRAPH if "." in m} <= set(FLOORS)


def test_no_import_runs_up_the_stack():
    upward = [f"{m} (floor {floor(m)}) -> {t} (floor {floor(t)})" for m, targets in sorted(GRAPH.items())
              for t in sorted(targets) if t != "cbteach" and floor(t) > floor(m)]
    assert upward == []


def test_only_the_command_line_imports_the_package_root():
    """``from cbteach import Engine`` inside the package would import every floor at once."""
    assert sorted(m for m, targets in GRAPH.items() if "cbteach" in targets and m != "cbteach.__main__") == []


def test_no_import_cycles():
    # Importing a package imports its __init__: an edge to cbteach.x.y also reaches cbteach.x.
    def reach(t):
        return {t} | {".".join(t.split(".")[:i]) for i in range(2, len(t.split(".")))}

    graph = {m: {r for t in ts for r in reach(t) if r in GRAPH and r != m} for m, ts in GRAPH.items()}
    graph = {m: {t for t in ts if not m.startswith(t + ".")} for m, ts in graph.items()}  # a package's own __init__
    state: dict[str, int] = {}
    cycles = []

    def visit(m, path):
        state[m] = 1
        for t in sorted(graph[m]):
            if state.get(t) == 1:
                cycles.append(path[path.index(t):] + [t])
            elif t not in state:
                visit(t, path + [t])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert cycles == []
