"""Faults of the launch itself: signals to the launcher (any moment, any of SIGINT, SIGTERM,
SIGHUP, SIGKILL), a rank that fails or is killed, and what the user reads at the end."""

from __future__ import annotations

import gzip
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from core import debug, run_folder
from recipes import launcher, output
from tests.dist_utils import ROOT
from tests.fault_utils import ROW, digest

pytestmark = pytest.mark.faults

CORPUS = ROOT / "assets" / "c4_offline" / "en"


def _shard_lines(n: int) -> list[bytes]:
    src = min(CORPUS.glob("c4-train.*.json.gz"))
    with gzip.open(src, "rb") as f:
        return [next(f) for _ in range(n)]


# -------------------------------------------------------------- signals and the log (slow)
def _as_from_a_terminal() -> None:
    """SIGHUP at its default in the launcher, as a terminal starts it: pytest itself may run under
    nohup (SIGHUP ignored, inherited), and a launcher keeps a SIGHUP it inherited ignored."""
    signal.signal(signal.SIGHUP, signal.SIG_DFL)


def _run_recipe(out: Path, *sets: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "recipes", "run", ROW, "--out", str(out), "--set", "metrics.log_freq=1"]
    for s in sets:
        cmd += ["--set", s]
    return subprocess.Popen(
        cmd,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=launcher.base_env(),
        preexec_fn=_as_from_a_terminal,
    )


def _wait_for_step(out: Path, step: int, timeout: float = 240.0, poll_s: float = 0.5) -> None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        metrics = out / "metrics.jsonl"
        if metrics.is_file() and any(json.loads(x)["step"] >= step for x in metrics.read_text().splitlines() if x):
            return
        time.sleep(poll_s)
    raise AssertionError(f"step {step} not reached in {timeout} s")


def _session_alive(pid: int) -> bool:
    try:
        os.killpg(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_stops_the_run_says_how_to_resume_and_keeps_the_log(tmp_path, sig):
    out = tmp_path / "run"
    ckpt = ("training.steps=200", "checkpoint.enabled=true", "checkpoint.interval=2")
    proc = _run_recipe(out, *ckpt)
    _wait_for_step(out, 3)
    proc.send_signal(sig)
    said, _ = proc.communicate(timeout=120)
    assert proc.returncode == 128 + sig, said
    last = said.strip().splitlines()[-1]
    assert last.startswith(f"stopped by {sig.name}: {ROW} in {out}") and "last complete checkpoint step 2" in last
    assert f"resume with: run-recipe run {ROW} --mode proxy --out {out}" in last
    assert not (out / run_folder.LOCK).exists()
    assert not _processes_of(out), "a rank outlived the launcher"
    log = (out / "train.log").read_bytes()
    assert b"loss" in log or b"step" in log  # what the ranks wrote before the stop
    if sig != signal.SIGTERM:
        return  # the resume after a stop does not depend on the signal: SIGTERM's case checks it
    # the resume continues from step 2 and appends to the log after a separator
    steps = sorted(int(p.name.split("-")[1]) for p in (out / "checkpoint").glob("step-*") if p.name[5:].isdigit())
    before = {s: digest(out / "checkpoint" / f"step-{s}") for s in steps}
    proc = _run_recipe(out, "training.steps=5", "checkpoint.enabled=true", "checkpoint.interval=2")
    said, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, said
    new_log = (out / "train.log").read_bytes()
    assert new_log.startswith(log) and output.SEPARATOR.encode() in new_log[len(log) :]
    assert json.loads((out / "result.json").read_text())["start_step"] == steps[-1]
    for s, d in before.items():
        if (out / "checkpoint" / f"step-{s}").is_dir():
            assert digest(out / "checkpoint" / f"step-{s}") == d


KILL_RUN = (  # small and short: start-up is most of it; a checkpoint every step
    "model.flavor=tiny",
    "training.seq_len=64",
    "training.steps=20",
    "checkpoint.enabled=true",
    "checkpoint.interval=1",
    "metrics.progress=false",
)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> dict:
    """The record of the killed runs' configuration run without interruption."""
    out = tmp_path_factory.mktemp("uninterrupted") / "run"
    said, _ = _run_recipe(out, *KILL_RUN).communicate(timeout=300)
    assert (out / "result.json").is_file(), said
    return json.loads((out / "result.json").read_text())


@pytest.mark.slow
def test_a_killed_rank_is_named_not_the_survivor(tmp_path):
    """A rank killed outright (SIGKILL: the OOM killer) leaves no error of its own, and the
    survivor's gloo error is a lost connection: the last line names the killed rank."""
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "recipes", "run", ROW, "--out", str(out), "--set", "training.steps=6"]
    env = {**launcher.base_env(), debug.PAUSE_ENV: "2:120:1"}
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    pid_file = out / "debug" / "pid_rank_1"
    t0 = time.monotonic()
    while not pid_file.is_file() and time.monotonic() - t0 < 240:
        time.sleep(0.1)
    os.kill(int(pid_file.read_text()), signal.SIGKILL)
    said, _ = proc.communicate(timeout=240)
    assert proc.returncode == 1, said
    last = said.strip().splitlines()[-1]
    assert f"{ROW}: rank 1 was killed by SIGKILL" in last, said
    assert "Connection" not in said and "Traceback" not in said, said


def _processes_of(out: Path) -> list[int]:
    """The run's torchrun agent and its ranks (forked from it, so sharing its command line)."""
    # `--` ends pgrep's options: the pattern starts with dashes (without it pgrep fails, rc 2)
    found = subprocess.run(["pgrep", "-f", "--", f"--config {out}/job.json"], capture_output=True, text=True)
    assert found.returncode in (0, 1), found.stderr
    return [int(pid) for pid in found.stdout.split()]


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGHUP])
def test_a_launcher_killed_or_hung_up_takes_its_ranks_and_the_rerun_resumes_bit_for_bit(tmp_path, uninterrupted, sig):
    """SIGKILL (the OOM killer) runs no cleanup; SIGHUP is a closed terminal. Either way no rank
    outlives the launcher by 10 s, the rerun resumes from the last complete checkpoint with the
    uninterrupted run's losses, and metrics.jsonl holds every step once."""
    out = tmp_path / "run"
    proc = _run_recipe(out, *KILL_RUN)
    _wait_for_step(out, 3, poll_s=0.05)
    proc.send_signal(sig)
    said, _ = proc.communicate(timeout=60)
    deadline = time.monotonic() + 10
    while _processes_of(out) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _processes_of(out), "a rank outlived its launcher by 10 s"
    if sig == signal.SIGHUP:  # heard: stopped as by SIGTERM, with the line that resumes
        assert proc.returncode == 128 + sig and "stopped by SIGHUP" in said and "resume with:" in said, said
    said, _ = _run_recipe(out, *KILL_RUN).communicate(timeout=300)
    rec = json.loads((out / "result.json").read_text())
    assert 2 <= rec["start_step"] < 20, said  # the kill came at step 3 or later
    resumed = uninterrupted["losses"][rec["start_step"] :]
    assert rec["losses"][-len(resumed) :] == resumed  # bit for bit
    steps = [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines() if x]
    assert steps == list(range(1, 21))


_SIGINT_IGNORED = """
import os, signal, sys
signal.signal(signal.SIGINT, signal.SIG_IGN)  # as a non-interactive shell starts a background job
from recipes import output
try:
    with output.stop_on_signals():
        os.kill(os.getpid(), signal.SIGINT)
        signal.pause()
except output.Stopped as e:
    sys.exit(e.exit_code)
"""


def test_sigint_is_heard_even_when_inherited_ignored():
    """A launcher started in the background of a script inherits SIGINT ignored: it must still
    stop on one (the flaky 'Ctrl-C not heard' of a quiet test run)."""
    proc = subprocess.run([sys.executable, "-c", _SIGINT_IGNORED], cwd=ROOT, timeout=60)
    assert proc.returncode == 128 + signal.SIGINT


def _catches(pid: int, sig: signal.Signals) -> bool:
    """Whether process `pid` has a handler of its own for `sig` (Linux: SigCgt of /proc/PID/status)."""
    status = Path(f"/proc/{pid}/status").read_text()
    caught = next(line.split()[1] for line in status.splitlines() if line.startswith("SigCgt:"))
    return bool(int(caught, 16) >> (sig - 1) & 1)


def _wait_for_start_up_handlers(proc: subprocess.Popen, timeout: float = 60.0) -> None:
    """Until the launcher's first lines have run (recipes/entry.py: SIGINT's handler, then
    SIGTERM's). Before them a SIGINT inherited ignored (a CI started in the background) is
    dropped by the kernel: no program hears a signal before its code runs."""
    t0 = time.monotonic()
    while not _catches(proc.pid, signal.SIGTERM):
        assert proc.poll() is None and time.monotonic() - t0 < timeout, "the launcher never started"
        time.sleep(0.01)


@pytest.mark.slow
@pytest.mark.parametrize(
    "sig,moment", [(signal.SIGINT, "start-up"), (signal.SIGTERM, "first step"), (signal.SIGINT, "a save")]
)
def test_every_signal_stops_the_run_at_any_moment(tmp_path, sig, moment):
    """Before the ranks exist (the CLI's imports), while the first step compiles, in the middle of
    saves (eager: a compile would only delay step 5)."""
    out = tmp_path / "run"
    compiled = ["compile.enabled=true"] if moment == "first step" else []
    proc = _run_recipe(out, *KILL_RUN, *compiled, "training.steps=400")
    try:
        _signal_at(proc, out, sig, moment)
    finally:
        if proc.poll() is None:  # a failed check leaves no run behind (it dies with its launcher)
            proc.kill()
            proc.wait()


def _signal_at(proc: subprocess.Popen, out: Path, sig: signal.Signals, moment: str) -> None:
    if moment == "start-up":
        _wait_for_start_up_handlers(proc)
    elif moment == "first step":  # the agent and both ranks are up, the ranks compiling
        t0 = time.monotonic()
        while len(_processes_of(out)) < 3 and time.monotonic() - t0 < 120:
            time.sleep(0.1)
        assert len(_processes_of(out)) >= 3, "the ranks never started"
        time.sleep(3.0)
    else:
        _wait_for_step(out, 5, poll_s=0.05)
    sent = time.monotonic()
    proc.send_signal(sig)
    said, _ = proc.communicate(timeout=120)
    assert proc.returncode == 128 + sig, said
    assert f"stopped by {sig.name}" in said.strip().splitlines()[-1]
    assert time.monotonic() - sent < 30, "the stop waited for the step to end"
    assert not _processes_of(out)


@pytest.mark.slow
@pytest.mark.parametrize("bad_rank", [None, 1])
def test_a_failed_rank_is_the_last_line(tmp_path, bad_rank):
    """A malformed document every rank reads (one shard, global sharding): said once. One only
    rank 1 reads (per-rank sharding, its own shard): rank 1 says it, located in its own shard,
    and that is the last line; the terminal shows no traceback, the log keeps them."""
    en = tmp_path / "corpus" / "en"
    en.mkdir(parents=True)
    shards = 1 if bad_rank is None else 2
    for i in range(shards):
        lines = _shard_lines(300 * (i + 1))[300 * i :]
        if i == (bad_rank or 0):
            lines[2:2] = [b'{"text": "unterminated\n']
        with gzip.open(en / f"c4-train.{i:05d}-of-{shards:05d}.json.gz", "wb") as f:
            f.writelines(lines)
    out = tmp_path / "run"
    sharding = "global" if bad_rank is None else "per_rank"
    proc = _run_recipe(out, f"data.path='{tmp_path / 'corpus'}'", "training.steps=3", f"data.sharding='{sharding}'")
    said, _ = proc.communicate(timeout=300)
    assert proc.returncode == 1, said
    last = said.strip().splitlines()[-1]
    bad_file = f"c4-train.{bad_rank or 0:05d}-of-{shards:05d}.json.gz:3"
    assert f"{ROW}: rank {bad_rank or 0}: error: " in last and "malformed document" in last and bad_file in last
    assert f"[log: {out / 'train.log'}]" in last
    assert "Traceback" not in said and "ChildFailedError" not in said, said
    assert "ChildFailedError" in (out / "train.log").read_text()  # torchrun's report stays in the log
    assert not (out / run_folder.LOCK).exists()
