"""Fault injection (issue: nothing lost, nothing silent): NaN gradients, damaged checkpoints, a
full disk, two runs on one folder, concurrent record writers, malformed configs and corpora.

Each case asserts the message, the exit code (or exception) and that no file of the previous
good state changed (digests before and after). The killed-rank-mid-save case is
tests/test_checkpoint.py::test_killed_rank_restarts_from_last_checkpoint (marked `faults` too).
Single-process cases run the real Trainer in this process; the multi-process one is `slow`.
"""

from __future__ import annotations

import errno
import gzip
import hashlib
import json
import math
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from click.testing import CliRunner
from torch.distributed.checkpoint import filesystem

from core.checkpoint_files import CheckpointError, complete_steps, load_model_weights
from core.config import ConfigError, load_config
from core.data.datasets import BadDocumentError
from core.train import NonFiniteError, run
from core.validate import validate
from recipes import launcher, registry
from recipes.cli import main as cli
from tests.dist_utils import ROOT, TINY_JOB, dist_env

pytestmark = pytest.mark.faults

CKPT = ["--checkpoint.enabled=true"]
NAN = [*CKPT, "--checkpoint.interval=1", "--optimizer.lr=1e6", "--lr_scheduler.warmup_steps=0"]
ROW = "llama3_8b/table1/8gpu_fsdp"  # proxy: world 2, tiny flavor


# --------------------------------------------------------------------------------- helpers
@pytest.fixture(scope="module")
def pg():
    owned = not dist.is_initialized()
    if owned:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    if owned:
        dist.destroy_process_group()


def train(out: Path, *overrides: str) -> dict:
    return run(validate(load_config(None, [*TINY_JOB, f"--job.output_dir={out}", *overrides]), 1, check_files=False))


def digest(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def invoke(*args):
    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


@pytest.fixture
def no_spawn(monkeypatch):
    def boom(*a, **k):
        raise AssertionError(f"spawned a process: {a}")

    monkeypatch.setattr(subprocess, "Popen", boom)
    monkeypatch.setattr(subprocess, "run", boom)


@pytest.fixture(scope="module")
def two_steps(pg, tmp_path_factory):
    """A run of 2 steps with a checkpoint after each (the good state the damage cases copy)."""
    out = tmp_path_factory.mktemp("good")
    rec = train(out, *CKPT, "--training.steps=2", "--checkpoint.interval=1")
    return out, rec


# ------------------------------------------------------------------------ non-finite guard
def test_nan_grad_is_never_saved(pg, tmp_path):
    """lr=1e6: step 2's loss is finite but its grad norm is NaN. The update is skipped, the run
    stops, step-1 (finite) stays the latest, unchanged; nothing of step 2 is on disk."""
    train(tmp_path, *NAN, "--training.steps=1")
    folder = tmp_path / "checkpoint"
    before = digest(folder)
    with pytest.raises(NonFiniteError, match=r"step 2: grad norm is nan \(loss [0-9.]+\).*last complete checkpoint"):
        train(tmp_path, *NAN, "--training.steps=4")
    assert list(complete_steps(folder)) == [1] and digest(folder) == before
    weights, _ = load_model_weights(folder / "step-1")
    assert all(torch.isfinite(w).all() for w in weights.values())


def test_nan_grad_skipped_up_to_n_steps(pg, tmp_path):
    rec = train(tmp_path, *NAN, "--training.steps=4", "--training.skip_nonfinite_steps=3")
    assert rec["skipped_nonfinite_steps"] == [2, 3, 4]
    for step, path in complete_steps(tmp_path / "checkpoint").items():
        weights, _ = load_model_weights(path)
        assert all(torch.isfinite(w).all() for w in weights.values()), step
    with pytest.raises(NonFiniteError, match=r"step 4: .*skip_nonfinite_steps=2"):
        train(tmp_path / "b", *NAN, "--training.steps=4", "--training.skip_nonfinite_steps=2")


# --------------------------------------------------------------------- damaged checkpoints
def _damage(step: Path, how: str) -> str:
    shard = step / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    if how == "zeros_64k":
        data[4096 : 4096 + 65536] = bytes(65536)
    elif how == "random_4k":
        data[8192 : 8192 + 4096] = os.urandom(4096)
    elif how == "truncated":
        del data[len(data) // 2 :]
    elif how == "no_manifest":
        (step / "manifest.json").unlink()
        return "manifest.json: missing"
    shard.write_bytes(bytes(data))
    return {
        "zeros_64k": "CRC32 mismatch at the same size",
        "random_4k": "CRC32 mismatch at the same size",
        "truncated": "truncated",
    }[how]


@pytest.mark.parametrize("how", ["zeros_64k", "random_4k", "truncated", "no_manifest"])
def test_corrupted_shard_is_named_and_never_loaded(two_steps, tmp_path, how):
    src, _ = two_steps
    shutil.copytree(src / "checkpoint", tmp_path / "checkpoint")
    what = _damage(tmp_path / "checkpoint" / "step-2", how)
    before = digest(tmp_path / "checkpoint")
    with pytest.raises(CheckpointError, match=rf"step-2/(__0_0\.distcp: .*)?{what}.*checkpoint\.load_step=1"):
        train(tmp_path, *CKPT, "--training.steps=4", "--checkpoint.interval=1")
    assert digest(tmp_path / "checkpoint") == before
    # and through resume_from (another run's folder): named too, nothing written
    with pytest.raises(CheckpointError, match=r"__0_0\.distcp|manifest\.json"):
        train(tmp_path / "other", *CKPT, f"--checkpoint.resume_from={tmp_path / 'checkpoint' / 'step-2'}")
    assert digest(tmp_path / "checkpoint") == before


def test_missing_metadata_latest_is_refused_then_moved_aside(two_steps, tmp_path):
    src, rec = two_steps
    folder = tmp_path / "checkpoint"
    shutil.copytree(src / "checkpoint", folder)
    (folder / "step-2" / ".metadata").unlink()
    before = digest(folder)
    with pytest.raises(CheckpointError, match=r"step-2/\.metadata: missing.*checkpoint\.load_step=1"):
        train(tmp_path, *CKPT, "--training.steps=3", "--checkpoint.interval=1")
    assert digest(folder) == before
    # resuming from step 1 as told: the damaged step-2 is moved aside (not overwritten), and the
    # steps 2..3 equal the uninterrupted run's step 2
    again = train(tmp_path, *CKPT, "--training.steps=3", "--checkpoint.interval=1", "--checkpoint.load_step=1")
    assert again["start_step"] == 1 and again["losses"][0] == rec["losses"][1]
    aside = [p for p in folder.iterdir() if p.name.startswith("step-2.damaged")]
    assert len(aside) == 1 and {f"step-2/{k}" for k in digest(aside[0])} <= set(before)
    assert list(complete_steps(folder)) == [1, 2, 3]


def test_manifest_written_last_and_bit_identical_resume(two_steps, tmp_path):
    src, rec = two_steps
    man = json.loads((src / "checkpoint" / "step-2" / "manifest.json").read_text())
    assert man["algorithm"] == "crc32" and {".metadata", "__0_0.distcp"} <= set(man["files"])
    resumed = train(
        tmp_path,
        *CKPT,
        "--training.steps=2",
        f"--checkpoint.resume_from={src / 'checkpoint'}",
        "--checkpoint.load_step=1",
    )
    assert resumed["losses"] == rec["losses"][1:]


def test_steps_not_above_the_resume_step(two_steps, tmp_path):
    src, _ = two_steps
    shutil.copytree(src / "checkpoint", tmp_path / "checkpoint")
    before = digest(tmp_path / "checkpoint")
    with pytest.raises(CheckpointError, match=r"training\.steps: 2 is not above the step 2"):
        train(tmp_path, *CKPT, "--training.steps=2")
    assert digest(tmp_path / "checkpoint") == before and not (tmp_path / "result.json").exists()
    cfg = validate(load_config(None, [*TINY_JOB, *CKPT, "--training.steps=2"]), 1, check_files=False)
    with pytest.raises(ConfigError, match=r"training\.steps: 2 is not above the step 2"):
        launcher.check_resume_step(cfg, tmp_path)
    cfg.checkpoint.resume_from = str(src / "checkpoint")  # another run's: its latest, step 2
    with pytest.raises(ConfigError, match=r"training\.steps: 2 is not above the step 2 .*step-2"):
        launcher.check_resume_step(cfg, tmp_path / "fresh")
    cfg.checkpoint.load_step = 1
    launcher.check_resume_step(cfg, tmp_path / "fresh")  # from step 1: 2 steps is one more


# ------------------------------------------------------------------------------ full disk
@pytest.mark.parametrize("mode", ["disabled", "async"])
def test_full_disk_removes_partial_and_keeps_latest(pg, tmp_path, monkeypatch, mode):
    train(tmp_path, *CKPT, "--training.steps=2", "--checkpoint.interval=1")
    folder = tmp_path / "checkpoint"
    before = digest(folder)
    real = filesystem.FileSystemWriter.write_data

    def full(self, plan, planner):  # a partial shard, then the disk is full
        (Path(self.path) / "__0_0.distcp").write_bytes(b"\0" * 1000)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(filesystem.FileSystemWriter, "write_data", full)
    with pytest.raises(CheckpointError) as err:
        train(tmp_path, *CKPT, "--training.steps=4", "--checkpoint.interval=1", f"--checkpoint.async_mode={mode}")
    msg = str(err.value)
    assert "step-3.tmp: checkpoint" in msg and "no space left on device" in msg
    assert "needs about" in msg and "MiB free" in msg and "kept: step-2" in msg and "\n" not in msg
    assert not list(folder.glob("*.tmp")) and list(complete_steps(folder)) == [1, 2]
    assert digest(folder) == before
    monkeypatch.setattr(filesystem.FileSystemWriter, "write_data", real)
    assert train(tmp_path, *CKPT, "--training.steps=3", "--checkpoint.interval=1")["start_step"] == 2


@pytest.fixture
def small_disk(tmp_path):
    """A 12 MiB tmpfs: one tiny checkpoint (8 MiB) fits, a second does not."""
    d = tmp_path / "fs"
    d.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=12m", "tmpfs", str(d)], check=False, capture_output=True)
    if r.returncode:
        pytest.skip("mounting a tmpfs needs root; test_full_disk_removes_partial_and_keeps_latest covers ENOSPC")
    yield d
    subprocess.run(["umount", "--lazy", str(d)], check=False)  # a failed run may hold a file open


def test_real_full_disk(pg, small_disk):
    """A real full file system: torch's writer reports no errno, the free space still tells."""
    out = small_disk / "run"
    train(out, *CKPT, "--training.steps=1")
    before = digest(out / "checkpoint")
    with pytest.raises(
        CheckpointError,
        match=r"step-2\.tmp: checkpoint save of step 2 failed: no space left on "
        r"device: a checkpoint needs about 8\.\d MiB, [0-9.]+ MiB free",
    ):
        train(out, *CKPT, "--training.steps=3", "--checkpoint.interval=1")
    assert digest(out / "checkpoint") == before and list(complete_steps(out / "checkpoint")) == [1]


# ----------------------------------------------------------------- shared output folders
def test_second_run_on_a_locked_folder_is_refused(tmp_path, no_spawn):
    out = tmp_path / "run"
    out.mkdir()
    (out / "job.json").write_text('{"the": "first run"}')
    with launcher.run_dir_lock(out):
        before = digest(out)
        res = invoke("run", ROW, "--out", str(out))
        assert res.exit_code == 2
        assert f"in use by another run (pid {os.getpid()} on host" in res.output and "use another --out" in res.output
        assert digest(out) == before
    assert not (out / launcher.LOCK).exists()  # released


def test_stale_lock_is_reported_and_taken_over(tmp_path, capsys):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (tmp_path / launcher.LOCK).write_text(
        json.dumps({"host": launcher.socket.gethostname(), "pid": dead.pid, "started": "2026-01-01T00:00:00+00:00"})
    )
    with launcher.run_dir_lock(tmp_path) as lock:
        assert json.loads(lock.read_text())["pid"] == os.getpid()
    assert f"stale lock of pid {dead.pid}" in capsys.readouterr().err
    (tmp_path / launcher.LOCK).write_text(json.dumps({"host": "elsewhere", "pid": 1, "started": "x"}))
    with (
        pytest.raises(launcher.RunDirBusy, match=r"pid 1 on host elsewhere.*remove the lock file"),
        launcher.run_dir_lock(tmp_path),
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
                launcher.copy_record(sources[i], tmp_path / "records", "proxy", recipe)
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


def test_metrics_continue_from_the_resumed_step(two_steps, tmp_path):
    src, _ = two_steps
    shutil.copytree(src, tmp_path / "run")
    shutil.rmtree(tmp_path / "run" / "checkpoint" / "step-2")  # as if killed after step 2's log line
    train(tmp_path / "run", *CKPT, "--training.steps=3", "--checkpoint.interval=1")
    steps = [json.loads(line)["step"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3]
    replaced = (tmp_path / "run" / "metrics.replaced.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in replaced] == [2]


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


def test_resume_step_refused_before_spawn(two_steps, tmp_path, no_spawn):
    src, _ = two_steps
    out = tmp_path / "out"
    shutil.copytree(src / "checkpoint", out / "checkpoint")
    before = digest(out)
    res = invoke("run", ROW, "--set", "checkpoint.enabled=true", "--set", "training.steps=2", "--out", str(out))
    assert res.exit_code == 2 and "training.steps: 2 is not above the step 2" in res.output
    assert digest(out) == before


def test_show_previews_overrides():
    res = invoke("show", ROW, "--set", "training.steps=7", "--set", "optimizer.lr=0.002")
    assert res.exit_code == 0, res.output
    row = next(line for line in res.output.splitlines() if line.startswith("training.steps"))
    assert row.split()[1:3] == ["7", "7"]  # paper, proxy (then the key's meaning)
    assert any(line.startswith("optimizer.lr") and "0.002" in line for line in res.output.splitlines())


# --------------------------------------------------------------------------- malformed data
def _corpus(tmp_path: Path, bad_line: bytes) -> Path:
    src = min((ROOT / "assets" / "c4_offline" / "en").glob("c4-train.*.json.gz"))
    with gzip.open(src, "rb") as f:
        lines = [next(f) for _ in range(300)]
    lines[:0] = [b'{"text": "a"}\n', b'{"text": "b"}\n', bad_line]  # reached by the first batch
    en = tmp_path / "corpus" / "en"
    en.mkdir(parents=True)
    with gzip.open(en / "c4-train.00000-of-00001.json.gz", "wb") as f:
        f.writelines(lines)
    return tmp_path / "corpus"


DATA = ["--data.dataset=c4_offline", "--training.steps=2", "--training.seq_len=32", "--training.local_batch_size=2"]


@pytest.mark.parametrize("bad", [b'{"text": "unterminated\n', b"not json at all\n", b'{"url": "no text"}\n'])
def test_malformed_corpus_line_named_or_skipped(pg, tmp_path, bad):
    corpus = _corpus(tmp_path, bad)
    before = digest(corpus)
    shard = corpus / "en" / "c4-train.00000-of-00001.json.gz"
    with pytest.raises(BadDocumentError, match=rf"{shard}:3: malformed document.*skip_bad_documents"):
        train(tmp_path / "a", *DATA, f"--data.path={corpus}")
    rec = train(tmp_path / "b", *DATA, f"--data.path={corpus}", "--data.skip_bad_documents=true")
    assert rec["skipped_bad_documents"] == [f"{shard}:3"] and all(map(math.isfinite, rec["losses"]))
    assert digest(corpus) == before


# ------------------------------------------------------------------- multi-process (slow)
@pytest.mark.slow
def test_nan_grad_world2_one_line_nonzero_exit(tmp_path):
    """world 2 (FSDP), lr=1e6, a checkpoint every step: exit 1, one 'error:' line (rank 0), no
    traceback, step-1 the latest and finite."""
    cmd = launcher.torchrun_command(
        2,
        launcher.trainer_target(
            None,
            [
                *TINY_JOB,
                *NAN,
                "--training.steps=4",
                "--parallelism.dp_shard=2",
                "--training.local_batch_size=4",
                f"--job.output_dir={tmp_path}",
            ],
        ),
    )
    proc = subprocess.run(cmd, check=False, cwd=ROOT, env=dist_env(2), capture_output=True, text=True, timeout=600)
    text = proc.stdout + proc.stderr
    errors = [line for line in text.splitlines() if line.startswith("error: ")]
    assert proc.returncode != 0 and len(errors) == 1, text[-3000:]
    assert "step 2: grad norm is nan" in errors[0]
    # no rank prints a traceback (torchrun's agent still reports the failed worker with its own)
    assert text.count("Traceback") == text.count("ChildFailedError:"), text[-3000:]
    assert list(complete_steps(tmp_path / "checkpoint")) == [1]
    weights, _ = load_model_weights(tmp_path / "checkpoint" / "step-1")
    assert all(torch.isfinite(w).all() for w in weights.values())


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
    assert (out / "job.json").read_bytes() == job and not (out / launcher.LOCK).exists()
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 13))
