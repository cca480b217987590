"""Every file `run-recipe results` writes is replaced atomically (core/fileio.py): a kill -9 at
any moment leaves each file old or new, never torn; its hidden leftovers are never listed in
README.md and the next run removes them. Tables are compared only between runs of the same code
on a copy of results/records, never against typed-in content."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from core.fileio import atomic_path, is_leftover, remove_leftovers
from recipes.report import results
from tests.committed import copy_committed_tree

pytestmark = pytest.mark.dryrun

ROOT = Path(__file__).resolve().parents[1]
RUN_RECIPE = Path(sys.executable).with_name("run-recipe")
LEFTOVERS = (".table1.xyz.tmp.png", ".loss_convergence.abc.tmp.csv")


@pytest.fixture(scope="module")
def records(tmp_path_factory) -> Path:
    # as committed: the main job rewrites the working tree's records
    return copy_committed_tree("results/records", tmp_path_factory.mktemp("records") / "records")


def _files(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in out.iterdir() if p.is_file() and not p.name.startswith(".")}


def _hidden(out: Path) -> list[str]:
    return sorted(p.name for p in out.iterdir() if p.name.startswith("."))


def test_leftover_names_are_atomic_paths_own(tmp_path):
    """remove_leftovers takes exactly what atomic_path leaves, nothing else."""
    with atomic_path(tmp_path / "table1.png") as tmp:
        assert is_leftover(tmp.name)
        tmp.write_bytes(b"x")
    kept = ["table1.png", ".keep", ".table1.png", "notes.tmp.md", "table1.xyz.tmp.png"]
    for name in [*kept, *LEFTOVERS]:
        (tmp_path / name).write_bytes(b"x")
    (tmp_path / ".sub.abc.tmp").mkdir()  # a folder is no writer's temporary file
    assert sorted(p.name for p in remove_leftovers(tmp_path)) == sorted(LEFTOVERS)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([*kept, ".sub.abc.tmp"])
    assert remove_leftovers(tmp_path / "missing") == []


def test_write_results_removes_leftovers_and_never_lists_them(records, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    for name in [*LEFTOVERS, ".notes.json"]:
        (out / name).write_bytes(b"half a file")
    (out / "extra.json").write_text("{}\n")  # a results file of someone else: still listed
    results.write_results(records, out)
    assert _hidden(out) == [".notes.json"]  # a hidden file not of the writer's: kept, not listed
    readme = (out / "README.md").read_text()
    assert "[extra.json](extra.json)" in readme
    for name in [*LEFTOVERS, ".notes.json"]:
        assert name not in readme


def _start(records: Path, out: Path) -> subprocess.Popen:
    cmd = [str(RUN_RECIPE), "results", "--records-dir", str(records), "--out", str(out)]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)


@pytest.mark.slow
def test_kill_9_leaves_every_file_old_or_new(records, tmp_path):
    """`run-recipe results` killed with SIGKILL at points spread over its run: every file is its
    old bytes or its new ones; a full run afterwards removes the leftovers."""
    out = tmp_path / "out"
    results.write_results(records, out)
    new = _files(out)
    old = {name: b"old version of " + name.encode() + b"\n" for name in new}
    t0 = time.monotonic()
    proc = _start(records, out)
    assert proc.wait(timeout=120) == 0, proc.stderr.read().decode()
    took = time.monotonic() - t0
    assert _files(out) == new  # the same bytes from the command as from the function
    mixed = 0
    for fraction in (0.3, 0.42, 0.54, 0.66, 0.78, 0.9):  # imports first, then the tables one by one
        for name, data in old.items():
            (out / name).write_bytes(data)
        proc = _start(records, out)
        time.sleep(took * fraction)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
        now = _files(out)
        assert set(now) == set(new), f"killed at {fraction:.0%}: {sorted(set(now) ^ set(new))}"
        torn = [n for n, data in now.items() if data not in (old[n], new[n])]
        assert not torn, f"killed at {fraction:.0%} of {took:.1f} s: torn {torn}"
        mixed += 0 < sum(now[n] == new[n] for n in now) < len(now)
    assert mixed, "no kill landed while the tables were being written: the test checked nothing"
    proc = _start(records, out)
    assert proc.wait(timeout=120) == 0, proc.stderr.read().decode()
    assert _files(out) == new and _hidden(out) == []
