"""core/fileio.py: the one atomic writer every file the project replaces goes through."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from core.fileio import atomic_copy, atomic_path, atomic_write, atomic_write_json

pytestmark = pytest.mark.core
ROOT = Path(__file__).resolve().parents[1]


def test_replaces_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "sub" / "a.json"
    atomic_write_json(path, {"x": 1})
    atomic_write(path, "new\n")
    assert path.read_text() == "new\n" and sorted(p.name for p in path.parent.iterdir()) == ["a.json"]
    assert path.stat().st_mode & 0o777 == 0o644
    atomic_copy(path, tmp_path / "b.json")
    assert (tmp_path / "b.json").read_text() == "new\n"


def test_a_failed_write_keeps_the_old_file(tmp_path):
    path = tmp_path / "a.csv"
    atomic_write(path, "old")
    with pytest.raises(RuntimeError), atomic_path(path) as tmp:
        tmp.write_text("half")
        raise RuntimeError("writer died")
    assert path.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["a.csv"]
    with pytest.raises(TypeError):
        atomic_write_json(path, {"x": object()})
    assert path.read_text() == "old" and json.loads(json.dumps([p.name for p in tmp_path.iterdir()])) == ["a.csv"]


def _replaces(path: Path) -> list[int]:
    """Lines that rename a file: os.replace / os.rename, or Path.replace / Path.rename (one
    positional argument; str.replace takes two, DataFrame.rename keywords)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        if node.func.attr not in ("replace", "rename"):
            continue
        on_os = isinstance(node.func.value, ast.Name) and node.func.value.id == "os"
        if on_os or (len(node.args) == 1 and not node.keywords):
            out.append(node.lineno)
    return out


def test_one_atomic_writer():
    """Files are replaced only in core/fileio.py; checkpoint *folders* are renamed only by their
    owner, core/checkpoint/folder.py."""
    owners = {"core/fileio.py", "core/checkpoint/folder.py"}
    bad = {
        str(p.relative_to(ROOT)): lines
        for pkg in ("core", "recipes")
        for p in sorted((ROOT / pkg).rglob("*.py"))
        if str(p.relative_to(ROOT)) not in owners and (lines := _replaces(p))
    }
    assert not bad, f"files replaced outside core/fileio.py: {bad}"
