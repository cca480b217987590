"""Fault injection before and around a run: two runs on
one folder, a stale lock, concurrent record writers, malformed configs, ids, modes and options.

Each case asserts the message and the exit code, that nothing was spawned for what is refused
before spawn, and that no file of the previous good state changed. Runs of the trainer and the
checkpoint faults are tests/test_faults.py; the multi-process case here is `slow`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

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


def test_stale_lock_is_reported_and_taken_over(tmp_path, capsys):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (tmp_path / run_folder.LOCK).write_text(
        json.dumps({"host": run_folder.socket.gethostname(), "pid": dead.pid, "started": "2026-01-01T00:00:00+00:00"})
    )
    with run_folder.lock(tmp_path) as lock:
        assert json.loads(lock.read_text())["pid"] == os.getpid()
    assert f"stale lock of pid {dead.pid}" in capsys.readouterr().err
    (tmp_path / run_folder.LOCK).write_text(json.dumps({"host": "elsewhere", "pid": 1, "started": "x"}))
    with (
        pytest.raises(run_folder.RunDirBusy, match=r"pid 1 on host elsewhere.*remove the lock file"),
        run_folder.lock(tmp_path),
    ):
        pass


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
