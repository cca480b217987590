"""How the suite shares work among pytest-xdist workers (tests/dist_utils.py, tests/conftest.py)."""

import threading
from pathlib import Path

import pytest

from tests import conftest
from tests.dist_utils import once_per_session


class _Factory:
    """A worker's tmp_path_factory: its basetemp is <run>/popen-gw<N>, as under pytest-xdist."""

    def __init__(self, run: Path, worker: str):
        self.base = run / f"popen-{worker}"
        self.base.mkdir(parents=True, exist_ok=True)

    def getbasetemp(self) -> Path:
        return self.base

    def mktemp(self, name: str) -> Path:
        path = self.base / name
        path.mkdir()
        return path


def test_workers_run_a_shared_job_once_and_read_one_result(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw0")
    calls, results = [], {}

    def compute(out: Path) -> dict:
        calls.append(out)
        out.mkdir(parents=True)
        (out / "result.json").write_text("{}")  # what a run leaves where both workers can read it
        return {"rows": [("fsdp2", 1.5)], "out": str(out)}

    def worker(name: str) -> None:
        results[name] = once_per_session("parity_fp32_w2", _Factory(tmp_path, name), compute)

    threads = [threading.Thread(target=worker, args=(w,)) for w in ("gw0", "gw1")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1 and calls[0] == tmp_path / "shared" / "parity_fp32_w2"
    assert results["gw0"] == results["gw1"] == {"rows": [["fsdp2", 1.5]], "out": str(calls[0])}
    assert (Path(results["gw1"]["out"]) / "result.json").is_file()


def test_without_workers_the_result_has_the_same_types(tmp_path, monkeypatch):
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    got = once_per_session("group_w2", _Factory(tmp_path, "main"), lambda out: {"rows": [("tp2", 2)], "dir": out.name})
    assert got == {"rows": [["tp2", 2]], "dir": "group_w2"}  # JSON either way: tuples read as lists


def test_a_failed_shared_job_leaves_nothing_and_the_next_worker_runs_it(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw0")

    def fail(out: Path) -> dict:
        raise RuntimeError("the trainer job failed")

    with pytest.raises(RuntimeError, match="trainer job failed"):
        once_per_session("group_w4", _Factory(tmp_path, "gw0"), fail)
    assert once_per_session("group_w4", _Factory(tmp_path, "gw1"), lambda out: {"ok": True}) == {"ok": True}


def test_the_longest_first_order_names_files_that_exist():
    """A renamed test file would drop out of the order silently, and start last."""
    here = Path(conftest.__file__).parent
    assert [name for name in conftest.LONGEST_FIRST if not (here / name).is_file()] == []
    assert len(set(conftest.LONGEST_FIRST)) == len(conftest.LONGEST_FIRST)


def test_auto_workers_are_the_usable_cores_capped(monkeypatch):
    monkeypatch.setattr(conftest.os, "sched_getaffinity", lambda pid: set(range(2)))
    assert conftest.pytest_xdist_auto_num_workers(None) == 2
    monkeypatch.setattr(conftest.os, "sched_getaffinity", lambda pid: set(range(64)))
    assert conftest.pytest_xdist_auto_num_workers(None) == conftest.MAX_WORKERS
