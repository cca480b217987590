"""`--out` onto a folder that is not a run's: a folder holding someone else's files is refused,
naming them, with nothing in it changed; so is the checkout's root or a folder above it. An empty,
new or earlier run's folder is taken as before (core/run_folder.py `make`)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from core import run_folder
from core.config import ConfigError

pytestmark = pytest.mark.faults

ROOT = Path(__file__).resolve().parents[1]
ROW = "llama3_8b/table1/8gpu_fsdp"
NAME = "llama3_8b__table1__8gpu_fsdp"
FOREIGN = {"config.json": '{"mine": 1}\n', "command.txt": "make all\n", "notes.md": "# notes\n"}


def _make(out, several: bool = False) -> Path:
    return run_folder.make(NAME, out, several, Path("/nonexistent-runs-root"))


def _foreign(folder: Path) -> dict[str, bytes]:
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in FOREIGN.items():
        (folder / name).write_text(text)
    return _snapshot(folder)


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in folder.iterdir()}


def test_a_folder_of_other_files_is_refused_naming_them(tmp_path):
    out = tmp_path / "mine"
    before = _foreign(out)
    with pytest.raises(run_folder.RunDirRefused) as e:
        _make(out)
    assert isinstance(e.value, ConfigError)  # the CLI's exit 2, "config error: <id>: ..."
    assert str(out) in str(e.value) and all(name in str(e.value) for name in FOREIGN)
    assert _snapshot(out) == before


def test_several_rows_refuse_a_foreign_row_folder_only(tmp_path):
    """DIR may hold anything (other rows' folders); DIR/<id> is the run folder checked."""
    (tmp_path / "elsewhere.txt").write_text("x")
    assert _make(tmp_path, several=True) == (tmp_path / NAME).resolve()
    (tmp_path / NAME / "notes.md").write_text("x")
    with pytest.raises(run_folder.RunDirRefused, match="notes.md"):
        _make(tmp_path, several=True)


def test_a_refusal_names_at_most_five_entries(tmp_path):
    for i in range(8):
        (tmp_path / f"f{i}.txt").write_text("x")
    (tmp_path / "sub").mkdir()
    with pytest.raises(run_folder.RunDirRefused) as e:
        _make(tmp_path)
    assert "f4.txt" in str(e.value) and "f5.txt" not in str(e.value) and "and 4 more" in str(e.value)


def test_empty_missing_and_earlier_run_folders_are_fine(tmp_path):
    (tmp_path / "empty").mkdir()
    assert _make(tmp_path / "empty") == (tmp_path / "empty").resolve()
    assert _make(tmp_path / "new" / "run").is_dir()
    for mark in run_folder.RUN_MARKS:  # a finished run's job.json, a killed run's lock, ...
        earlier = tmp_path / f"earlier{mark}"
        _foreign(earlier)
        if mark == "checkpoint":
            (earlier / mark).mkdir()
        else:
            (earlier / mark).write_text("{}\n")
        assert _make(earlier) == earlier.resolve()


def test_the_checkout_and_a_folder_above_it_are_refused(tmp_path):
    assert run_folder.checkout_root() == ROOT
    with pytest.raises(run_folder.RunDirRefused, match="is the checkout's root"):
        _make(ROOT)
    with pytest.raises(run_folder.RunDirRefused, match=r"holds the checkout"):
        _make(ROOT.parent)
    with pytest.raises(run_folder.RunDirRefused, match="holds the checkout"):
        _make(ROOT.parent, several=True)  # DIR/<id> would be new, but DIR holds the checkout
    with pytest.raises(run_folder.RunDirRefused, match="is the checkout's root"):
        _make(ROOT, several=True)
    assert not (ROOT / NAME).exists() and not (ROOT.parent / NAME).exists()


def test_cli_refuses_a_foreign_out_before_anything_runs(tmp_path):
    out = tmp_path / "mine"
    before = _foreign(out)
    run_recipe = Path(sys.executable).with_name("run-recipe")
    res = subprocess.run(
        [str(run_recipe), "run", ROW, "--out", str(out)], capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    assert res.returncode == 2, res.stdout + res.stderr
    line = res.stderr.strip().splitlines()[-1]
    assert line.startswith(f"config error: {ROW}: --out: {out} is not empty and holds no run"), line
    assert all(name in line for name in FOREIGN)
    assert _snapshot(out) == before
