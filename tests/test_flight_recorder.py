"""Debugging a stuck or slow collective: the Flight Recorder's
config, dump and reader (which rank is behind), and the process-group timeouts after step 1.

Single-process tests run in this process (a world-1 gloo group); the multi-process one launches
torchrun and is marked slow.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch.distributed as dist

from core.config import load_config
from core.debug import (
    analyze,
    dump_flight_recorder,
    format_report,
    pg_timeout_seconds,
    read_traces,
    setup_flight_recorder,
    torchfrtrace,
)
from core.train import run
from core.validate import validate
from tests.dist_utils import TINY_JOB, run_trainer

pytestmark = pytest.mark.checkpoint


# --------------------------------------------------------------------------------- helpers


def _cfg(out: Path, *overrides: str):
    return validate(load_config(None, [*TINY_JOB, f"--job.output_dir={out}", *overrides]), 1, check_files=False)


def train(out: Path, *overrides: str) -> dict:
    return run(_cfg(out, *overrides))


# ------------------------------------------------------------------ single process (fast)
def test_pg_timeouts_shorten_after_first_step(pg, tmp_path):
    dist.distributed_c10d._set_pg_timeout(__import__("datetime").timedelta(seconds=300))
    train(tmp_path, "--training.steps=2", "--comm.train_timeout_seconds=77")
    assert pg_timeout_seconds() == 77


def test_flight_recorder_config_and_reader(pg, tmp_path, monkeypatch):
    for k in (
        "TORCH_FR_BUFFER_SIZE",
        "TORCH_NCCL_TRACE_BUFFER_SIZE",
        "TORCH_FR_DUMP_TEMP_FILE",
        "TORCH_NCCL_DUMP_ON_TIMEOUT",
        "TORCH_NCCL_DEBUG_INFO_TEMP_FILE",
    ):
        monkeypatch.setenv(k, "")  # so that the values set below are undone after the test
        monkeypatch.delenv(k)
    cfg = _cfg(tmp_path, "--comm.trace_buf_size=64")
    folder = setup_flight_recorder(cfg)
    assert os.environ["TORCH_FR_BUFFER_SIZE"] == "64" == os.environ["TORCH_NCCL_TRACE_BUFFER_SIZE"]
    assert os.environ["TORCH_FR_DUMP_TEMP_FILE"] == str(tmp_path / "comm_traces" / "rank_")
    assert os.environ["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1" and folder.is_dir()
    assert setup_flight_recorder(_cfg(tmp_path)) is None  # 0 disables
    path = dump_flight_recorder(cfg, reason="test")
    d = read_traces(path.parent)[0]
    assert d["titan_reason"] == "test" and d["pg_config"]  # filled for torchfrtrace
    # the analysis on two synthetic ranks: rank 1 never issued the collective rank 0 waits in
    e = {"process_group": ("3", "dp_shard_cp"), "state": "scheduled", "input_sizes": [[8]]}
    traces = {
        0: {"entries": [dict(e, collective_seq_id=s, profiling_name="gloo:all_gather") for s in (1, 2, 3)]},
        1: {"entries": [dict(e, collective_seq_id=s, profiling_name="gloo:all_gather") for s in (1, 2)]},
    }
    lag = analyze(traces)["lagging"]
    assert lag == [
        {"group": "3", "desc": "dp_shard_cp", "ranks": [1], "waiting_ranks": [0], "op": "gloo:all_gather", "seq": 3}
    ]


# ---------------------------------------------------------------- multi-process (slow)
@pytest.mark.slow
def test_flight_recorder_dump_on_collective_timeout(tmp_path):
    """Rank 1 stalls after step 3; rank 0 hits the 3 s train timeout (not the 300 s init one)
    in its next collective, dumps its Flight Recorder buffer; torchrun's SIGTERM makes rank 1
    dump too; the reader names rank 1 as the one behind."""
    out = tmp_path / "run"
    env = {"TITAN_DEBUG_PAUSE": "3:60:1"}  # rank 1 sleeps 60 s after step 3
    with pytest.raises(RuntimeError, match="trainer failed"):
        _run_env(
            2,
            [
                *TINY_JOB,
                "--training.steps=6",
                "--parallelism.dp_shard=2",
                "--training.local_batch_size=4",
                "--comm.trace_buf_size=2000",
                "--comm.train_timeout_seconds=3",
            ],
            out,
            env,
        )
    paused = (out / "debug" / "pid_rank_1").stat().st_mtime
    folder = out / "comm_traces"
    traces = read_traces(folder)
    assert 0 in traces and "Timed out" in traces[0]["titan_reason"]
    # within the 3 s train timeout (+ slack), long before rank 1 wakes or the 300 s init timeout
    assert (folder / "rank_0").stat().st_mtime - paused < 30
    assert any(e["profiling_name"].startswith("gloo:") for e in traces[0]["entries"])
    report = analyze(traces)
    assert 1 in traces and traces[1]["titan_reason"] == "SIGTERM"  # torchrun stopped it after rank 0 failed
    assert [1] in [lag["ranks"] for lag in report["lagging"]], format_report(report, traces)
    assert "missing ranks: {1}" in torchfrtrace(folder)  # torch's analyser agrees


def _run_env(nproc, overrides, out_dir, env_extra):
    old = {k: os.environ.get(k) for k in env_extra}
    os.environ.update(env_extra)
    try:
        return run_trainer(nproc, overrides, out_dir, timeout=600)
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
