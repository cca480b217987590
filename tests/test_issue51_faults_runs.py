"""Issue 51's faults, launched: one rank of a 4-rank proxy stopped (`kill -STOP`) is the one the
last line names, with the Flight Recorder and without; a damaged compile cache file (a wrapper of
random bytes, a 0-byte kernel library, a 0-byte ISA probe) is named, moved aside, and the compile
goes on with the same result. The in-process halves are in tests/test_issue51_faults.py."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from core import debug
from recipes import launcher
from tests.dist_utils import ROOT

pytestmark = [pytest.mark.faults, pytest.mark.slow]

ROW4 = "llama3_8b/table1/128gpu_fsdp"  # proxy: world 4, FSDP 4, tiny flavor


def _wait_for(path: Path, timeout: float = 300.0) -> None:
    t0 = time.monotonic()
    while not path.is_file():
        assert time.monotonic() - t0 < timeout, f"{path} not written in {timeout} s"
        time.sleep(0.1)


@pytest.mark.parametrize("flight_recorder", [False, True], ids=["fr_off", "fr_on"])
def test_a_stopped_rank_is_the_one_the_last_line_names(tmp_path, flight_recorder):
    """Rank 2 pauses after step 2 and is stopped there; ranks 0, 1, 3 time out in step 3's first
    all-gather (5 s). The last line used to blame a survivor (`rank 1: RuntimeError: ... Timed out
    waiting 5000ms for send operation`); it names rank 2. torchrun kills the stopped rank after its
    own 30 s grace."""
    out = tmp_path / "run"
    sets = ["training.seq_len=64", "training.steps=5", "comm.train_timeout_seconds=5", "metrics.log_freq=1"]
    sets += ["comm.trace_buf_size=2000"] if flight_recorder else []
    cmd = [sys.executable, "-m", "recipes", "run", ROW4, "--out", str(out)]
    for s in sets:
        cmd += ["--set", s]
    env = {**launcher.base_env(), debug.PAUSE_ENV: "2:600:2"}
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    pid = None
    try:
        _wait_for(out / "debug" / "pid_rank_2")
        pid = int((out / "debug" / "pid_rank_2").read_text())
        os.kill(pid, signal.SIGSTOP)
        said, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):  # the rank this test stopped, if torchrun left it
                os.kill(pid, signal.SIGKILL)
    assert proc.returncode == 1, said
    last = said.strip().splitlines()[-1]
    assert f"{ROW4}: rank 0: error: collective timeout after 5 s: rank 2 " in last, said
    if flight_recorder:
        assert "rank 2 left no Flight Recorder dump: the prime suspect" in last, said
        fr = [sys.executable, "-m", "core.debug", "fr", str(out / "comm_traces")]
        report = subprocess.run(fr, cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert "Rank 2 left no Flight Recorder dump: the prime suspect" in report.stdout, report
    else:
        assert "rank 2 never reached the collective that ranks 0, 1, 3 failed in" in last, said


COMPILED = """
import json
import torch
from core.toggles.compile import ensure_cache_dir, probe_cpu_isas_in_background, survive_damaged_cache
ensure_cache_dir()
survive_damaged_cache()
probe_cpu_isas_in_background()
f = torch.compile(lambda x: (x * 2).sin() + 1)
print(json.dumps(f(torch.arange(8.0)).tolist()))
"""


def test_a_damaged_compile_cache_file_is_named_moved_aside_and_the_compile_goes_on(tmp_path):
    """What the trainer's compile does (core/toggles/compile.py), on a function, in fresh processes
    sharing one cache: cold, then with one file damaged at a time. Each damage used to fail every
    later run (UnicodeDecodeError; ImportError: file too short; a C++ compile error after a 0-byte
    ISA probe) until the cache was deleted by hand."""
    cache = tmp_path / "cache"
    env = {**launcher.base_env(), "TORCHINDUCTOR_CACHE_DIR": str(cache), "OMP_NUM_THREADS": "1"}

    def run() -> tuple[list, str]:
        proc = subprocess.run(
            [sys.executable, "-c", COMPILED], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        return json.loads(proc.stdout.splitlines()[-1]), proc.stderr

    cold, _ = run()
    wrapper = next(p for p in cache.glob("*/c*.py"))
    kernel = next(p for p in cache.glob("*/c*.main.so"))
    probes = [p for p in cache.glob("*/c*.so") if not p.name.endswith(".main.so")]
    damages = [(wrapper, os.urandom(4000)), (kernel, b"")] + [(probes[0], b"")] * bool(probes)
    for path, junk in damages:
        path.write_bytes(junk)
        warm, err = run()
        assert warm == cold
        aside = path.with_name(path.name + ".damaged")
        assert f"warning: compile cache damaged: {path} does not load" in err, err[-3000:]
        assert f"moved aside to {aside.name}" in err and f"rm -rf {cache}" in err
        assert aside.read_bytes() == junk and path.is_file() and path.read_bytes() != junk  # built again
