"""Fault injection before and around a run: two runs on
one folder, a stale lock, concurrent record writers, malformed configs, ids, modes and options.

Each case asserts the message and the exit code, that nothing was spawned for what is refused
before spawn, and that no file of the previous good state changed. Runs of the trainer and the
checkpoint faults are tests/test_faults.py; the multi-process case here is `slow`.
"""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from core import run_folder
from recipes import registry
from tests import fault_utils
from tests.dist_utils import ROOT
from tests.fault_utils import ROW, digest, invoke

pytestmark = pytest.mark.faults
no_spawn = fault_utils.no_spawn  # the fixture, registered in this module by name


# ----------------------------------------------------------------- shared output folders
def test_second_run_on_a_locked_folder_is_refused(tmp_path, no_spawn):
    out = tmp_path / "run"
    out.mkdir()
    (out / "job.json").write_text('{"the": "first run"}')
    with run_folder.lock(out):
        before = digest(out)
        res = invoke("run", ROW, "--out", str(out))
        assert res.exit_code == 2
        assert f"in use by another run (pid {os.getpid()} on host" in res.output and "use another --out" in res.output
        assert digest(out) == before
    assert not (out / run_folder.LOCK).exists()  # released


def _lock_file(folder: Path, age_s: float = 0.0, **holder) -> Path:
    path = folder / run_folder.LOCK
    path.write_text(json.dumps(holder) if holder else "")
    os.utime(path, (time.time() - age_s, time.time() - age_s))
    return path


def test_stale_lock_is_reported_and_taken_over(tmp_path, capsys):
    """A dead process's lock on this host, and a pid since reused by a live process: the kernel's
    flock says no process holds either."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    for pid in (dead.pid, os.getppid()):  # gone; alive, but holding nothing
        _lock_file(tmp_path, host=run_folder.socket.gethostname(), pid=pid, started="2026-01-01T00:00:00+00:00")
        with run_folder.lock(tmp_path) as lock:
            assert json.loads(lock.read_text())["pid"] == os.getpid()
        assert f"pid {pid} on host" in (err := capsys.readouterr().err) and "held by no live process: taken over" in err


def test_a_lock_left_on_another_host_is_taken_over_once_untouched(tmp_path, capsys):
    """A job resubmitted after its node died: the lock names a host that no longer exists. Taken
    over with a note once its heartbeat stopped (an hour here); refused while it is fresh."""
    _lock_file(tmp_path, 3600, host="node-gone-17", pid=4242, started="2026-11-27T03:00:00+00:00")
    with run_folder.lock(tmp_path):
        pass
    err = capsys.readouterr().err
    assert "pid 4242 on host node-gone-17" in err and "untouched for 60 min" in err and "taken over" in err
    _lock_file(tmp_path, 20, host="node-alive-3", pid=4242, started="x")
    busy = r"pid 4242 on host node-alive-3.*touched 20 s ago: taken over if"
    with pytest.raises(run_folder.RunDirBusy, match=busy), run_folder.lock(tmp_path):
        pass


def test_an_empty_lock_names_itself_and_a_full_disk_leaves_none(tmp_path, capsys, monkeypatch):
    _lock_file(tmp_path)  # 0 bytes: a claim that ran out of disk
    with run_folder.lock(tmp_path):
        pass
    assert "an unreadable lock file (0 bytes), held by no live process: taken over" in capsys.readouterr().err

    def full(fd, data, offset):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(run_folder.os, "pwrite", full)
    with pytest.raises(OSError, match="No space left"), run_folder.lock(tmp_path):
        pass
    assert not (tmp_path / run_folder.LOCK).exists()


_HOLD = """
import sys, time
from pathlib import Path
from core import run_folder
folder = Path(sys.argv[1])
if sys.argv[2] == "own":
    with run_folder.lock(folder):
        print("held", flush=True)
        time.sleep(600)
else:
    run_folder.hold(folder)
    print("held", flush=True)
    time.sleep(600)
"""


def _holder(folder: Path, how: str) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-c", _HOLD, str(folder), how], cwd=ROOT, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_a_live_run_or_a_rank_of_a_killed_launcher_keeps_the_folder(tmp_path, capsys):
    """A live owner is refused by name; killed outright (SIGKILL: no cleanup) while one of its
    ranks still holds the folder, the folder stays refused; once the rank is gone, taken over."""
    owner = _holder(tmp_path, "own")
    with pytest.raises(run_folder.RunDirBusy, match=f"pid {owner.pid} on host"), run_folder.lock(tmp_path):
        pass
    rank = _holder(tmp_path, "hold")
    owner.kill()
    owner.wait()
    with pytest.raises(run_folder.RunDirBusy, match=f"pid {owner.pid}"), run_folder.lock(tmp_path):
        pass
    rank.kill()
    rank.wait()
    with run_folder.lock(tmp_path):
        pass
    assert f"pid {owner.pid} on host" in capsys.readouterr().err


def test_concurrent_record_writers_never_tear(tmp_path):
    recipe = registry.get(ROW)
    sources = []
    for i in range(4):
        f = tmp_path / f"result{i}.json"
        f.write_text(json.dumps({"writer": i, "pad": "x" * 200_000}))
        sources.append(f)
    dest = tmp_path / "records" / "proxy" / f"{recipe.fname}.json"
    errors, seen = [], set()

    def write(i):
        try:
            for _ in range(20):
                run_folder.copy_record(sources[i], tmp_path / "records", "proxy", recipe.fname)
        except Exception as e:  # noqa: BLE001 - collected and asserted below
            errors.append(e)

    def read():
        for _ in range(200):
            if dest.is_file():
                seen.add(json.loads(dest.read_text())["writer"])  # never a torn file

    threads = [threading.Thread(target=write, args=(i,)) for i in range(4)] + [threading.Thread(target=read)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert json.loads(dest.read_text())["writer"] in range(4) and seen <= set(range(4))
    assert [p.name for p in dest.parent.iterdir()] == [dest.name]  # no temporary left


# ------------------------------------------------------------------ malformed inputs (before spawn)
@pytest.fixture(scope="module")
def not_a_tokenizer(tmp_path_factory):
    f = tmp_path_factory.mktemp("tok") / "tokenizer.model"
    f.write_text("this is not a tokenizer\n")
    return f


BAD_SETS = [  # (--set value, the key the message names)
    ("optimizer.lr=nan", "optimizer.lr"),
    ("optimizer.lr=inf", "optimizer.lr"),
    ("optimizer.lr=0", "optimizer.lr"),
    ("optimizer.lr=-1e-3", "optimizer.lr"),
    ("optimizer.beta1=2", "optimizer.beta1"),
    ("optimizer.beta1=1", "optimizer.beta1"),
    ("optimizer.beta1=-0.1", "optimizer.beta1"),
    ("optimizer.beta2=1.5", "optimizer.beta2"),
    ("optimizer.beta2=nan", "optimizer.beta2"),
    ("optimizer.eps=0", "optimizer.eps"),
    ("optimizer.eps=-1e-8", "optimizer.eps"),
    ("optimizer.weight_decay=-0.1", "optimizer.weight_decay"),
    ("optimizer.weight_decay=nan", "optimizer.weight_decay"),
    ("optimizer.name=Lion", "optimizer.name"),
    ("optimizer.lr='fast'", "optimizer.lr"),
    ("lr_scheduler.min_lr_factor=2", "lr_scheduler.min_lr_factor"),
    ("lr_scheduler.warmup_steps=-1", "lr_scheduler.warmup_steps"),
    ("lr_scheduler.decay_type=step", "lr_scheduler.decay_type"),
    ("training.max_norm=nan", "training.max_norm"),
    ("training.steps=0", "training.steps"),
    ("training.steps=1.5", "training.steps"),
    ("training.local_batch_size=0", "training.local_batch_size"),
    ("training.seq_len=0", "training.seq_len"),
    ("training.grad_accum_steps=0", "training.grad_accum_steps"),
    ("training.skip_nonfinite_steps=-1", "training.skip_nonfinite_steps"),
    ("training.mixed_precision_param=fp8", "training.mixed_precision_param"),
    ("parallelism.dp_shard=64", "job.proxy_world_limit"),
    ("parallelism.dp_shard=0", "parallelism.dp_shard"),
    ("parallelism.tp=0", "parallelism.tp"),
    ("parallelism.tp=3", "parallelism"),
    ("model.flavor=nope", "model.flavor"),
    ("checkpoint.interval=0", "checkpoint.interval"),
    ("checkpoint.keep_latest_k=-1", "checkpoint.keep_latest_k"),
    ("checkpoint.load_step=-2", "checkpoint.load_step"),
    ("checkpoint.folder='/abs'", "checkpoint.folder"),
    ("checkpoint.async_mode=sometimes", "checkpoint.async_mode"),
    ("checkpoint.resume_from='/nowhere/at/all'", "checkpoint.resume_from"),
    ("comm.train_timeout_seconds=0", "comm.train_timeout_seconds"),
    ("comm.trace_buf_size=-1", "comm.trace_buf_size"),
    ("metrics.log_freq=0", "metrics.log_freq"),
    ("metrics.peak_flops=-1", "metrics.peak_flops"),
    ("job.proxy_world_limit=0", "job.proxy_world_limit"),
    ("data.dataset=imagenet", "data.dataset"),
    ("data.path='/nowhere/corpus'", "data.path"),
    ("activation_checkpoint.mode=most", "activation_checkpoint.mode"),
    ("tokenizer.sha256='00ff'", "tokenizer.path"),
    ("nosection.key=1", "nosection"),
    ("optimizer.nokey=1", "optimizer.nokey"),
    ("optimizer.lr", "optimizer.lr"),
]


def test_at_least_40_malformed_config_values():
    assert len(BAD_SETS) >= 40 and len({b[0] for b in BAD_SETS}) == len(BAD_SETS)


@pytest.mark.parametrize(("override", "key"), BAD_SETS, ids=[b[0] for b in BAD_SETS])
def test_malformed_config_refused_before_spawn(tmp_path, no_spawn, override, key):
    res = invoke("run", ROW, "--set", override, "--out", str(tmp_path / "out"))
    assert res.exit_code == 2, res.output
    assert key in res.output and len(res.output.strip().splitlines()) == 1, res.output
    assert not (tmp_path / "out").exists()


def test_not_a_tokenizer_refused_before_spawn(tmp_path, no_spawn, not_a_tokenizer):
    res = invoke("run", ROW, "--set", f"tokenizer.path='{not_a_tokenizer}'", "--out", str(tmp_path / "o"))
    assert res.exit_code == 2 and "tokenizer.path" in res.output and "not a readable tokenizer" in res.output


@pytest.mark.parametrize(
    "args",
    [
        ("run", "nope/row"),
        ("run", ROW, "--mode", "fast"),
        ("run",),
        ("run", ROW, "--mode", "proxy", "--slurm"),
        ("show", "nope/row"),
        ("show", ROW, "--set", "optimizer.beta1=2"),
    ],
)
def test_bad_ids_modes_options_refused(tmp_path, no_spawn, args):
    res = invoke(*args)
    assert res.exit_code == 2, res.output


def test_show_previews_overrides():
    res = invoke("show", ROW, "--set", "training.steps=7", "--set", "optimizer.lr=0.002")
    assert res.exit_code == 0, res.output
    row = next(line for line in res.output.splitlines() if line.startswith("training.steps"))
    assert row.split()[1:3] == ["7", "7"]  # paper, proxy (then the key's meaning)
    assert any(line.startswith("optimizer.lr") and "0.002" in line for line in res.output.splitlines())


# ------------------------------------------------------------------- multi-process (slow)
@pytest.mark.slow
def test_two_runs_on_one_folder(tmp_path):
    """`run-recipe run --out D` twice, the second while the first trains: the second exits 2 naming
    the first (pid, host) before spawning anything; the first's files are its own and it exits 0."""
    out = tmp_path / "run"
    args = [
        sys.executable,
        "-m",
        "recipes.cli",
        "run",
        ROW,
        "--out",
        str(out),
        "--set",
        "training.steps=12",
        "--set",
        "metrics.progress=false",
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    with open(tmp_path / "first.log", "w") as log:
        first = subprocess.Popen(args, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            deadline = time.time() + 120
            while not (out / "metrics.jsonl").is_file():  # training has started
                assert first.poll() is None and time.time() < deadline, (tmp_path / "first.log").read_text()
                time.sleep(0.2)
            job = (out / "job.json").read_bytes()
            second = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120, check=False)
            assert second.returncode == 2, second.stdout + second.stderr
            assert f"in use by another run (pid {first.pid} on host" in second.stderr
            assert first.wait(timeout=600) == 0, (tmp_path / "first.log").read_text()[-3000:]
        finally:
            if first.poll() is None:
                first.kill()
    assert (out / "job.json").read_bytes() == job and not (out / run_folder.LOCK).exists()
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 13))
