"""Fault injection in a run: NaN gradients, damaged
checkpoints and resumes, a full disk, malformed corpora.

Each case asserts the message, the exit code (or exception) and that no file of the previous
good state changed (digests before and after). The killed-rank-mid-save case is
tests/test_checkpoint.py::test_killed_rank_restarts_from_last_checkpoint (marked `faults` too);
shared output folders and malformed inputs are tests/test_faults_inputs.py.
Single-process cases run the real Trainer in this process; the multi-process one is `slow`.
"""

from __future__ import annotations

import errno
import gzip
import json
import math
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint import filesystem

from core import run_folder
from core.checkpoint.files import load_model_weights
from core.checkpoint.folder import CheckpointError, complete_steps
from core.config import ConfigError, load_config
from core.data.documents import BadDocumentError
from core.train import NonFiniteError, run
from core.validate import validate
from recipes import launcher
from tests import fault_utils
from tests.dist_utils import ROOT, TINY_JOB, dist_env
from tests.fault_utils import ROW, digest, invoke

pytestmark = pytest.mark.faults
no_spawn = fault_utils.no_spawn  # the fixture, registered in this module by name

CKPT = ["--checkpoint.enabled=true"]
NAN = [*CKPT, "--checkpoint.interval=1", "--optimizer.lr=1e6", "--lr_scheduler.warmup_steps=0"]


# --------------------------------------------------------------------------------- helpers


def train(out: Path, *overrides: str) -> dict:
    return run(validate(load_config(None, [*TINY_JOB, f"--job.output_dir={out}", *overrides]), 1, check_files=False))


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
    # resuming from step 1 as told: the damaged step-2 (every step after 1) is moved aside before
    # the next save (not overwritten), and the steps 2..3 equal the uninterrupted run's step 2
    again = train(tmp_path, *CKPT, "--training.steps=3", "--checkpoint.interval=1", "--checkpoint.load_step=1")
    assert again["start_step"] == 1 and again["losses"][0] == rec["losses"][1]
    aside = [p for p in folder.iterdir() if p.name.startswith("step-2.superseded-")]
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
        run_folder.check_resume(cfg, tmp_path)
    cfg.checkpoint.resume_from = str(src / "checkpoint")  # another run's: its latest, step 2
    with pytest.raises(ConfigError, match=r"training\.steps: 2 is not above the step 2 .*step-2"):
        run_folder.check_resume(cfg, tmp_path / "fresh")
    cfg.checkpoint.load_step = 1
    run_folder.check_resume(cfg, tmp_path / "fresh")  # from step 1: 2 steps is one more


def test_resume_step_refused_before_spawn(two_steps, tmp_path, no_spawn):
    src, _ = two_steps
    out = tmp_path / "out"
    shutil.copytree(src / "checkpoint", out / "checkpoint")
    before = digest(out)
    res = invoke("run", ROW, "--set", "checkpoint.enabled=true", "--set", "training.steps=2", "--out", str(out))
    assert res.exit_code == 2 and "training.steps: 2 is not above the step 2" in res.output
    assert digest(out) == before


def test_metrics_continue_from_the_resumed_step(two_steps, tmp_path):
    src, _ = two_steps
    shutil.copytree(src, tmp_path / "run")
    shutil.rmtree(tmp_path / "run" / "checkpoint" / "step-2")  # as if killed after step 2's log line
    train(tmp_path / "run", *CKPT, "--training.steps=3", "--checkpoint.interval=1")
    steps = [json.loads(line)["step"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3]
    replaced = (tmp_path / "run" / "metrics.replaced.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in replaced] == [2]


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


@pytest.mark.parametrize("with_thread", [False, True])
def test_fast_exit_keeps_exit_code_atexit_and_writes(with_thread):
    """exit_process skips only the interpreter's teardown: the code, the atexit handlers and the
    buffered output survive; a live non-daemon thread (a writer) still finishes first."""
    script = (
        "import atexit, sys, threading, time\n"
        "from core.process import exit_process\n"
        "atexit.register(lambda: print('atexit ran'))\n"
        f"if {with_thread!r}:\n"
        "    threading.Thread(target=lambda: (time.sleep(0.5), print('thread done', flush=True))).start()\n"
        "sys.stdout.write('buffered ')\n"
        "exit_process(3)\n"
        "print('unreachable')\n"
    )
    proc = subprocess.run(
        [launcher.sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120, check=False
    )
    assert proc.returncode == 3, proc.stderr[-2000:]
    assert proc.stdout.startswith("buffered ") and "atexit ran" in proc.stdout and "unreachable" not in proc.stdout
    assert ("thread done" in proc.stdout) == with_thread
