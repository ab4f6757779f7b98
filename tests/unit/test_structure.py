"""The shape of the code, read from the source with ast: the layers import only downwards (LAYERS,
docs/ARCHITECTURE.md draws them), no import circle among the project's modules (imports inside
functions count: a lazy import hides a circle, it does not break it), no module loaded by a name
in a string, no package folder over MAX_FOLDER_MODULES modules, and no class over
MAX_CLASS_LINES lines without a reason in its docstring. And ruff and mypy, as pyproject.toml
configures them, find nothing (the README's test command runs them through this file)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("supervisor", "workers", "chaos", "bench")
MAX_CLASS_LINES = 300
MAX_FOLDER_MODULES = 15

# Each layer and the layers it may import (its own modules always). What crosses fork() is in
# workers.protocol, which imports nothing of ours; the worker side never imports the parent's
# side (only the config tree both read); the views (observe) read a Snapshot and never the parent.
# supervisor.logcontext is the job a log record belongs to: set by the worker side, read by the
# formatters (supervisor.logs) the workers inherit; it imports nothing, so both sides may import it.
BASE = {"supervisor", "supervisor.errors", "supervisor.logs", "supervisor.logcontext"}
LAYERS: dict[str, set[str]] = {
    "workers.protocol": set(),
    "workers": {"workers.protocol"},
    "workers.middleware": {"workers", "workers.protocol", "supervisor.config", "supervisor.errors",
                           "supervisor.logcontext"},
    "workers.runtime": {"workers", "workers.middleware", "workers.protocol", "supervisor.config", "supervisor.errors"},
    "supervisor": set(), "supervisor.errors": set(), "supervisor.logcontext": set(),
    "supervisor.logs": {"supervisor.logcontext"}, "supervisor.__main__": {"supervisor.cli"},
    "supervisor.config": {"supervisor.errors"},
    "supervisor.core": {"supervisor.config", "supervisor.errors", "workers.protocol"},
    "supervisor.nats": {"supervisor.config", "workers.protocol", *BASE},
    "supervisor.observe": {"supervisor.config", "supervisor.core", "workers.protocol", *BASE},
    "supervisor.parent": {"supervisor.config", "supervisor.core", "supervisor.nats", "supervisor.observe", "workers",
                          "workers.middleware", "workers.protocol", "workers.runtime", *BASE},
    "supervisor.demo": {"supervisor.cli", "supervisor.config", "supervisor.nats", "workers.protocol", *BASE},
    "supervisor.cli": {"supervisor.config", "supervisor.core", "supervisor.demo", "supervisor.nats", "supervisor.parent",
                       "workers.middleware", "workers.runtime", *BASE},     # middleware: publish's producer span
}
LONG_CLASS_REASON = "Long because"          # the docstring phrase that explains a longer class


def modules() -> dict[str, Path]:
    found = {}
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imports_of(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """Project modules `name` imports anywhere in its file."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{a.name}" for a in node.names] + [base]
        else:
            continue
        for t in targets:
            while t and t not in known:          # `from pkg import mod` or `from mod import name`
                t = t.rpartition(".")[0]
            if t and t != name:
                out.add(t)
    return out


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def project_graph() -> dict[str, set[str]]:
    known = modules()
    graph = {name: imports_of(name, path, known) for name, path in known.items()}
    # A package's __init__ re-exporting its modules is not a circle of theirs.
    for name in graph:
        if name in PACKAGES:
            graph[name] = {t for t in graph[name] if not t.startswith(name + ".")}
    return graph


def layer_of(module: str) -> str:
    """`supervisor.parent.arbiter` -> `supervisor.parent`; chaos and bench are tools, not layers."""
    parts = module.split(".")
    for depth in (2, 1):
        name = ".".join(parts[:depth])
        if name in LAYERS or name in ("chaos", "bench"):
            return name
    return module


def broken_rules(graph: dict[str, set[str]]) -> list[str]:
    out = []
    for module, targets in sorted(graph.items()):
        here = layer_of(module)
        if here not in LAYERS:
            continue
        for t in sorted(targets):
            there = layer_of(t)
            if there != here and there not in LAYERS[here]:
                out.append(f"{module} imports {t} ({here} may not import {there})")
    return out


def test_the_layer_rule_sees_an_import_upwards():
    assert broken_rules({"workers.runtime.worker": {"supervisor.parent.arbiter"}}) == [
        "workers.runtime.worker imports supervisor.parent.arbiter (workers.runtime may not import supervisor.parent)"]
    assert broken_rules({"supervisor.observe.status": {"supervisor.parent.pool"}})
    assert broken_rules({"workers.protocol.slots": {"supervisor.config"}})
    assert broken_rules({"supervisor.parent.arbiter": {"workers.protocol.slots", "supervisor.core.ledger"}}) == []


def test_every_module_is_in_a_layer_and_the_layers_import_downwards():
    graph = project_graph()
    strays = [m for m in graph if layer_of(m) not in LAYERS and layer_of(m) not in ("chaos", "bench")]
    assert not strays, f"modules outside every layer (add them to LAYERS): {strays}"
    assert broken_rules(graph) == []


def test_no_package_folder_is_a_flat_heap():
    for pkg in PACKAGES:
        for folder in [ROOT / pkg, *(p for p in (ROOT / pkg).rglob("*") if p.is_dir() and p.name != "__pycache__")]:
            n = len([p for p in folder.glob("*.py") if p.name != "__init__.py"])
            assert n <= MAX_FOLDER_MODULES, f"{folder.relative_to(ROOT)} has {n} modules: give it sub-packages"


def test_test_files_have_names_of_their_own():
    """The tests folders are not packages: pytest imports each test file by its bare name, so two
    files of one name (tests/unit/x.py beside tests/integration/x.py) fail collection."""
    seen: dict[str, list[str]] = {}
    for path in (ROOT / "tests").rglob("*.py"):
        if path.name != "__init__.py" and "__pycache__" not in path.parts:
            seen.setdefault(path.name, []).append(str(path.relative_to(ROOT)))
    assert not {name: paths for name, paths in seen.items() if len(paths) > 1}


def test_the_import_walker_sees_a_circle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_circle_among_the_projects_modules():
    graph = project_graph()
    assert "supervisor.cli.main" in graph and "supervisor.config" in graph["supervisor.cli.main"]
    assert cycles(graph) == []


def test_no_module_is_imported_by_a_name_in_a_string():
    """`importlib.import_module("supervisor.x")` hides an arrow from readers and tools; only the
    user's handler (workers.handler, a name from the config) is loaded that way."""
    allowed = {"supervisor/parent/supervisor.py"}
    for path in modules().values():
        rel = str(path.relative_to(ROOT))
        if rel in allowed:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) in \
                    ("import_module", "__import__"):
                raise AssertionError(f"{rel}:{node.lineno} imports a module by a string")


def test_long_classes_say_why():
    too_long = []
    for path in modules().values():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_CLASS_LINES and LONG_CLASS_REASON not in (ast.get_docstring(node) or ""):
                    too_long.append(f"{path.relative_to(ROOT)}: {node.name} ({lines} lines)")
    assert not too_long, "split these, or say in the docstring why not ('Long because ...'): " + ", ".join(too_long)


def run_tool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True, timeout=240)


def test_ruff_finds_nothing():
    r = run_tool("ruff", "check", "--no-cache", ".")
    assert r.returncode == 0, r.stdout + r.stderr


def test_mypy_finds_nothing():
    r = run_tool("mypy", "--no-incremental", "--cache-dir", "/dev/null")
    assert r.returncode == 0, r.stdout + r.stderr
