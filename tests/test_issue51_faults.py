"""Issue 51's faults, in this process: a crafted Flight Recorder dump is refused before anything in
it runs; a rank that left no dump is the prime suspect; a collective timeout names the ranks that
never reached it, not the survivor that timed out; the failed rank's own error is read from its
entry of torchrun's failure report; a damaged compile cache file is named and moved aside, never a
file outside the cache. The launches (a stopped rank of four, damaged caches) are in
tests/test_issue51_faults_runs.py."""

from __future__ import annotations

import io
import pickle
from pathlib import Path

import pytest
import torch.distributed as dist
import torch.jit._pickle

from core import debug
from core.config import load_config
from core.validate import validate
from recipes import output
from tests.dist_utils import TINY_JOB

pytestmark = pytest.mark.faults

GLOO_TIMEOUT = "[../gloo/transport/tcp/unbound_buffer.cc:129] Timed out waiting 5000ms for send operation to complete"


def _cfg(out: Path, *overrides: str):
    return validate(load_config(None, [*TINY_JOB, f"--job.output_dir={out}", *overrides]), 1, check_files=False)


def _entry(seq: int, op: str = "gloo:all_gather") -> dict:
    return {"process_group": ("0", "default_pg"), "collective_seq_id": seq, "profiling_name": op, "state": "scheduled"}


def _dump(ranks: str = "[0, 1, 2, 3]", seqs=(1, 2, 3), **extra) -> dict:
    return {
        "pg_config": {"0": {"name": "0", "desc": "default_pg", "ranks": ranks}},
        "entries": [_entry(s) for s in seqs],
        **extra,
    }


# ------------------------------------------------------------------- a crafted dump (task 3)
class _WritesAFile:
    """A pickle that, loaded with plain pickle, creates `marker` (io.open(marker, "w"))."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


def test_a_crafted_flight_recorder_dump_is_refused_naming_the_file(tmp_path, capsys):
    live, marker = tmp_path / "live", tmp_path / "marker"
    pickle.loads(pickle.dumps({"entries": [_WritesAFile(live)]}))
    assert live.exists()  # the payload works: plain pickle runs it
    folder = tmp_path / "comm_traces"
    folder.mkdir()
    (folder / "rank_0").write_bytes(pickle.dumps(_dump()))
    (folder / "rank_1").write_bytes(pickle.dumps({"entries": [_WritesAFile(marker)]}))
    with pytest.raises(debug.UnsafeDump, match=r"rank_1: refused, not a Flight Recorder dump: .*io\.open"):
        debug.read_traces(folder)
    for args in (["fr", str(folder)], ["fr", str(folder), "--torchfrtrace"]):  # torch's analyser: plain pickle
        assert debug.main(args) == 2
        assert f"{folder / 'rank_1'}: refused" in capsys.readouterr().err
    assert not marker.exists()


def test_what_torch_dumps_hold_is_admitted(pg, tmp_path):
    """A dump torch wrote (gloo's recorder, world 1), and the typed lists torch's C++ pickler writes
    through torch.jit._pickle (returned as lists, nothing imported)."""
    path = debug.dump_flight_recorder(_cfg(tmp_path, "--comm.trace_buf_size=64"), reason="test")
    assert debug.read_traces(path.parent)[0]["titan_reason"] == "test"

    class _IntList:
        def __reduce__(self):
            return (torch.jit._pickle.build_intlist, ([8, 4],))

    raw = pickle.dumps({"entries": [dict(_entry(1), input_sizes=[_IntList()])]})
    assert b"build_intlist" in raw
    assert debug.load_dump(raw, "x")["entries"][0]["input_sizes"] == [[8, 4]]
    for bad in (pickle.dumps([1, 2]), b"not a pickle", pickle.dumps(io.BytesIO)):
        with pytest.raises(debug.UnsafeDump, match="^y: refused"):
            debug.load_dump(bad, "y")


# ------------------------------------------------------------ the missing dump (task 1, reader)
def test_a_rank_with_no_dump_is_the_prime_suspect(tmp_path, capsys):
    """A stopped rank never dumps; the others all issued the same last collective: the reader used
    to say "No rank is behind". The job's ranks come from the dumps' process-group table."""
    traces = {r: _dump() for r in (0, 1, 3)}
    report = debug.analyze(traces)
    assert report["missing"] == [2] and report["lagging"] == []
    said = debug.format_report(report, traces)
    assert "Rank 2 left no Flight Recorder dump: the prime suspect" in said and "No rank is behind" not in said
    assert "last in gloo:all_gather #3 of group 0 (default_pg)" in said
    every = {r: _dump() for r in range(4)}
    assert "No rank is behind" in debug.format_report(debug.analyze(every), every)
    folder = tmp_path / "comm_traces"
    folder.mkdir()
    for r, d in traces.items():
        (folder / f"rank_{r}").write_bytes(pickle.dumps(d))
    assert debug.main(["fr", str(folder)]) == 0
    assert "Rank 2 left no Flight Recorder dump" in capsys.readouterr().out


# --------------------------------------------------------- a timeout names the hung (task 1)
@pytest.fixture
def world_of_4(pg, monkeypatch):
    monkeypatch.setattr(debug, "ROLL_CALL_S", 0.5)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 4)


def _reported(cfg, *ranks: int) -> None:
    folder = Path(cfg.job.output_dir) / "debug" / "timeouts" / debug.launch_id()
    folder.mkdir(parents=True, exist_ok=True)
    for r in ranks:
        (folder / f"rank_{r}").write_text(GLOO_TIMEOUT)


def test_a_timeout_names_the_rank_that_never_reported_one(world_of_4, tmp_path):
    """Flight Recorder off: ranks 1 and 3 timed out too, rank 2 never did (stopped)."""
    cfg = _cfg(tmp_path)
    _reported(cfg, 1, 3)
    said = debug.name_the_hung(cfg, RuntimeError(GLOO_TIMEOUT))
    assert said.startswith("collective timeout after 5 s: rank 2 never reached the collective that ranks 0, 1, 3 ")
    assert "comm.trace_buf_size" in said


def test_a_timeout_with_the_flight_recorder_names_the_rank_with_no_dump(world_of_4, tmp_path, capsys):
    """Flight Recorder on: this launch's dumps of ranks 0 (this rank), 1 and 3; rank 2's dump in
    the folder is an older launch's (a resumed run), so it does not count."""
    cfg = _cfg(tmp_path, "--comm.trace_buf_size=64")
    folder = debug.fr_folder(cfg)
    folder.mkdir(parents=True)
    for r in (1, 3):
        (folder / f"rank_{r}").write_bytes(pickle.dumps(_dump(titan_launch=debug.launch_id())))
    (folder / "rank_2").write_bytes(pickle.dumps(_dump(titan_launch="an-older-launch.0")))
    _reported(cfg, 1, 3)
    assert debug.report_failure(cfg, RuntimeError(GLOO_TIMEOUT)) is True
    err = capsys.readouterr().err
    assert "error: collective timeout after 5 s: rank 2 left no Flight Recorder dump: the prime suspect" in err
    assert f"See: python -m core.debug fr {folder}" in err


def test_a_rank_that_lost_its_connection_to_a_timed_out_peer_is_a_survivor_too(world_of_4, tmp_path):
    """A rank that timed out closes its gloo connections: a neighbour still waiting fails on the lost
    connection instead (seen at world 4). It reached the collective too; the timeout is the others'."""
    cfg = _cfg(tmp_path)
    _reported(cfg, 1, 3)
    lost = RuntimeError("[../gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:11992")
    said = debug.name_the_hung(cfg, lost)
    assert said.startswith("collective timeout after 5 s: rank 2 never reached the collective that ranks 0, 1, 3 ")


def test_a_lost_connection_with_no_timeout_is_a_peer_that_failed(world_of_4, tmp_path, capsys):
    """No rank timed out: a peer failed (killed, or its own error), and says so; nothing is named here."""
    cfg = _cfg(tmp_path)
    folder = Path(cfg.job.output_dir) / "debug" / "timeouts" / debug.launch_id()
    folder.mkdir(parents=True)
    (folder / "rank_3").write_text("Connection reset by peer")
    assert debug.report_failure(cfg, RuntimeError("Connection closed by peer")) is False
    assert "error:" not in capsys.readouterr().err


def test_a_rank_above_the_lowest_that_timed_out_stays_quiet(world_of_4, tmp_path, monkeypatch):
    cfg = _cfg(tmp_path)
    _reported(cfg, 0)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 1)
    assert debug.name_the_hung(cfg, RuntimeError(GLOO_TIMEOUT)) == ""


def test_a_timeout_every_rank_reported_names_no_one(pg, tmp_path):
    """World 1: the one rank timed out (nothing to name): the caller raises it as before."""
    assert debug.name_the_hung(_cfg(tmp_path), RuntimeError(GLOO_TIMEOUT)) is None
    assert not debug.failed_in_collective(RuntimeError("shapes do not match"))


# ---------------------------------------------------------- torchrun's failure report (task 2)
BOX = """torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
_run_module_as_main FAILED
------------------------------------------------------------
Failures:
{failures}
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-11-29_01:33:43
  host      : localhost
  rank      : {rank} (local_rank: {rank})
  exitcode  : 1 (pid: 14547)
  error_file: {error_file}
  traceback : {traceback}
============================================================
"""
TRACEBACK = """Traceback (most recent call last):
    File "/x/torch/_inductor/runtime/compile_tasks.py", line 29, in _reload_python_module
      raise RuntimeError(
  torch._dynamo.exc.BackendCompilerFailed: backend='inductor' raised:
  RuntimeError: Failed to import /c/cg/ccg4.py
  UnicodeDecodeError: 'utf-8' codec can't decode byte 0xe6 in position 0: invalid continuation byte

  Set TORCHDYNAMO_VERBOSE=1 for the internal stack trace"""


def test_the_failed_ranks_error_is_read_from_its_entry_of_torchruns_report(tmp_path):
    """Rank 1 fails first; its one-line report is not an `...Error:` line, and the report's lines
    carry no prefix (read as rank 0's): the summary said only "rank 1 exited with code 1"."""
    log = tmp_path / "train.log"
    box = BOX.format(failures="  <NO_OTHER_FAILURES>", rank=1, error_file="/tmp/e/1/error.json", traceback=TRACEBACK)
    log.write_text("step 1/2 ...\n[rank1]: BackendCompilerFailed: backend='inductor' raised:\n" + box)
    assert output.failure_cause(log) == (
        "rank 1: BackendCompilerFailed: backend='inductor' raised: RuntimeError: Failed to import /c/cg/ccg4.py"
    )


def test_without_an_error_file_the_ranks_own_exception_line_is_read(tmp_path):
    """torchrun's own agent (real runs) has no error file of the rank: its one-line report is used,
    a `...Failed` exception as any `...Error`."""
    log = tmp_path / "train.log"
    no_file = "To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html"
    box = BOX.format(failures="  <NO_OTHER_FAILURES>", rank=1, error_file="<N/A>", traceback=no_file)
    log.write_text("[rank1]: BackendCompilerFailed: backend='inductor' raised:\n" + box)
    assert output.failure_cause(log) == "rank 1: BackendCompilerFailed: backend='inductor' raised:"


def test_another_ranks_entry_is_never_read_as_rank_0s(tmp_path):
    """Rank 0 failed first with no error file; the report also lists rank 2's lost connection,
    unprefixed: that line is rank 2's, not rank 0's cause."""
    failures = (
        "[1]:\n  time      : 2026-11-29_01:33:44\n  host      : localhost\n  rank      : 2 (local_rank: 2)\n"
        "  exitcode  : 1 (pid: 3)\n  error_file: /tmp/e/2/error.json\n"
        "  traceback : Traceback (most recent call last):\n"
        '    File "/x/y.py", line 1, in f\n      g()\n  RuntimeError: [pair.cc:553] Connection closed by peer'
    )
    log = tmp_path / "train.log"
    no_file = "To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html"
    log.write_text(BOX.format(failures=failures, rank=0, error_file="<N/A>", traceback=no_file))
    assert output.failure_cause(log) == "rank 0 exited with code 1"


# ------------------------------------------------------------ a damaged cache file (task 4)
def test_a_damaged_cache_file_is_named_and_moved_aside_and_nothing_outside_the_cache(tmp_path, monkeypatch):
    from core.toggles import compile as compile_toggle

    cache = tmp_path / "cache"
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(cache))
    so = cache / "fg" / "cfg.main.so"
    so.parent.mkdir(parents=True)
    so.write_bytes(b"")
    try:
        try:
            raise ImportError(f"{so}: file too short")
        except ImportError as inner:
            raise RuntimeError("backend='inductor' raised:\nImportError: ...") from inner
    except RuntimeError as e:
        failure = e
    assert compile_toggle.damaged_cache_file(failure) == (so, "ImportError: file too short")
    said = debug._cache_damage(failure)
    assert said == (
        f"compile cache damaged: {so} does not load (ImportError: file too short); moved aside to cfg.main.so.damaged, "
        f"so that it is built again (to clear the whole cache: rm -rf {cache})"
    )
    assert not so.exists() and (so.parent / "cfg.main.so.damaged").is_file()
    outside = tmp_path / "elsewhere" / "lib.so"
    outside.parent.mkdir()
    outside.write_bytes(b"")
    assert debug._cache_damage(ImportError(f"{outside}: file too short")) is None
    wrapper = cache / "cg" / "ccg.py"
    wrapper.parent.mkdir()
    wrapper.write_bytes(b"\xe6\x00")
    named = RuntimeError(f"Failed to import {wrapper}\nUnicodeDecodeError: 'utf-8' codec can't decode byte 0xe6")
    why = "UnicodeDecodeError: 'utf-8' codec can't decode byte 0xe6"
    assert compile_toggle.damaged_cache_file(named) == (wrapper, why)
    assert outside.is_file()
