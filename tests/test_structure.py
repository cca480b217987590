"""The code's shape: dependencies run one way, no import cycles, small modules, and
the dry-run's accounting loads without torch. Imports are read with `ast` (module and function
level; `if TYPE_CHECKING:` blocks are type names only and not followed)."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.core

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("core", "recipes")
MAX_LINES = 500


def _modules() -> dict[str, Path]:
    """Dotted name -> file of every module under the project's packages."""
    out = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = path
    return out


def _is_type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING"
    )


def _imported_names(tree: ast.AST, module: str, is_pkg: bool) -> list[tuple[str, int]]:
    """(dotted name, line) of everything the module imports, at any depth."""
    out = []
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and _is_type_checking(node):
            stack.extend(node.orelse)
            continue
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the module's package
                pkg = module.split(".") if is_pkg else module.split(".")[:-1]
                pkg = pkg[: len(pkg) - node.level + 1]
                base = ".".join([*pkg, base] if base else pkg)
            out += [(f"{base}.{a.name}", node.lineno) for a in node.names]
            out.append((base, node.lineno))
        stack.extend(ast.iter_child_nodes(node))
    return out


def import_graph() -> dict[str, dict[str, int]]:
    """Project module -> {project module it imports: first line}."""
    mods = _modules()
    graph: dict[str, dict[str, int]] = {}
    for name, path in mods.items():
        tree = ast.parse(path.read_text(), str(path))
        edges: dict[str, int] = {}
        for target, line in _imported_names(tree, name, path.name == "__init__.py"):
            # `from pkg import mod` names a module; `from mod import name` names the module
            while target and target not in mods:
                target = target.rpartition(".")[0]
            if target and target != name and target not in PACKAGES:
                edges.setdefault(target, line)
        graph[name] = edges
    return graph


def cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, {}):
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
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(out)


def _describe(graph: dict[str, dict[str, int]], comp: list[str]) -> str:
    members = set(comp)
    edges = [f"{a} -> {b} (line {line})" for a in comp for b, line in graph[a].items() if b in members]
    return "; ".join(edges)


def test_import_walker_sees_function_level_imports():
    graph = import_graph()
    # core.config imports the torch-free stage arithmetic at module level ...
    assert "core.parallel.stages" in graph["core.config"]
    # ... and the type-only import back is not an edge; a function-level import is one.
    assert "core.config" not in graph["core.parallel.stages"]
    assert "core.parallel.schedule_sim" in graph["core.dryrun.memory"]
    assert cycles({"a": {"b": 1}, "b": {"c": 1}, "c": {"a": 1}, "d": {"a": 1}}) == [["a", "b", "c"]]


def test_core_never_imports_recipes():
    graph = import_graph()
    bad = [
        f"{a} -> {b} (line {line})"
        for a, edges in graph.items()
        if a.startswith("core")
        for b, line in edges.items()
        if b.startswith("recipes")
    ]
    assert not bad, "core imports the harness: " + "; ".join(bad)


def test_no_import_cycles():
    graph = import_graph()
    found = cycles(graph)
    assert not found, "import cycles: " + " | ".join(_describe(graph, c) for c in found)


def _long_modules() -> dict[str, int]:
    """Every Python file of the checkout we write (the packages, the tests, the scripts), by path."""
    files = [p for d in (*PACKAGES, "tests", "scripts") for p in sorted((ROOT / d).rglob("*.py"))]
    return {str(p.relative_to(ROOT)): n for p in files if (n := len(p.read_text().splitlines())) > MAX_LINES}


def test_no_module_over_500_lines():
    long = _long_modules()
    assert not long, f"modules over {MAX_LINES} lines: {long}"


MAX_FUNCTION_LINES = 80


def _long_functions() -> dict[str, int]:
    """`path::name` -> lines (from `def` to its last line, decorators not counted) of every
    function or method in the packages, nested ones included, longer than MAX_FUNCTION_LINES."""
    out = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    n = node.end_lineno - node.lineno + 1
                    if n > MAX_FUNCTION_LINES:
                        out[f"{path.relative_to(ROOT).as_posix()}::{node.name}"] = n
    return out


def test_no_function_over_80_lines():
    long = _long_functions()
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines: {long}"


@pytest.mark.parametrize(
    "module",
    [
        "core.dryrun.memory",
        "core.dryrun.activations",
        "core.config",
        "core.parallel.stages",
        "core.models.args",
        "core.checkpoint.folder",
        "core.fileio",
        "recipes.cli",  # `run-recipe --version`, `list`, `keys`, `--help`: answered without torch's seconds
    ],
)
def test_torch_free_modules_load_without_torch(module):
    code = f"import sys, {module}; bad = [m for m in sys.modules if m.split('.')[0] == 'torch']; print(len(bad))"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, check=True, timeout=120
    )
    assert out.stdout.strip() == "0", f"importing {module} loads torch"
