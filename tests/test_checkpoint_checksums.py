"""Checkpoint checksums that scale (issue 27): each rank checksums the files it wrote and every
rank gets the parts, from which rank 0 writes the manifest; before a load each rank verifies an
even share of the files; the checkpoint's collectives run on their own group with
`comm.checkpoint_timeout_seconds`; rank 0 reports a long save. The world-4 cases run the real
trainer under torchrun (tests/checkpoint_driver.py, which records the files each rank hashed);
the scale simulation is scripts/checkpoint_checksum_sim.py.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import time
import zlib
from pathlib import Path

import pytest
import torch.distributed.checkpoint as dcp

from core import train as train_module
from core.checkpoint import collectives
from core.checkpoint.checkpointer import Checkpointer
from core.checkpoint.folder import MANIFEST, complete_steps
from core.checkpoint.manifest import checksum_files, read_manifest, shares, write_manifest, written_by
from core.config import ConfigError, load_config
from core.debug import pg_timeout_seconds
from core.train import run
from core.validate import validate
from tests.dist_utils import ROOT, TINY_JOB, dist_env, torchrun_command
from tests.fault_utils import digest

pytestmark = pytest.mark.checkpoint

CKPT = ["--checkpoint.enabled=true"]
FSDP4 = [*CKPT, "--parallelism.dp_shard=4", "--training.local_batch_size=2"]
ASYNC = ["--checkpoint.async_mode=async"]


def train(out: Path, *overrides: str) -> dict:
    return run(validate(load_config(None, [*TINY_JOB, f"--job.output_dir={out}", *overrides]), 1, check_files=False))


# ------------------------------------------------------------------ single process (fast)
def test_each_rank_claims_the_files_it_wrote(tmp_path):
    """DCP's names: rank R wrote `__R_n.distcp`, rank 0 also `.metadata`; titan.json and the
    manifest are nobody's; a file nobody claims is checksummed by rank 0 when it writes the manifest."""
    data = {
        "__0_0.distcp": b"a" * 100,
        "__0_1.distcp": b"b" * 10,
        "__1_0.distcp": b"c" * 50,
        "__3_0.distcp": b"",
        "__12_0.distcp": b"d",
        ".metadata": b"m" * 7,
        "extra.bin": b"x" * 3,
        "titan.json": b"{}",
    }
    for name, content in data.items():
        (tmp_path / name).write_bytes(content)
    assert written_by(tmp_path, 0) == [".metadata", "__0_0.distcp", "__0_1.distcp"]
    assert written_by(tmp_path, 1) == ["__1_0.distcp"] and written_by(tmp_path, 2) == []
    assert written_by(tmp_path, 12) == ["__12_0.distcp"]
    parts = [checksum_files(tmp_path, written_by(tmp_path, r)) for r in range(4)]
    assert parts[0]["bytes"] == 117 and parts[2] == {"files": {}, "bytes": 0, "seconds": parts[2]["seconds"]}
    write_manifest(tmp_path, parts)
    manifest = json.loads((tmp_path / MANIFEST).read_text())
    assert manifest["algorithm"] == "crc32"
    assert set(manifest["files"]) == set(data) - {"titan.json"}  # extra.bin and __12_0 by rank 0
    data.pop("titan.json")
    assert all(manifest["files"][n] == {"size": len(c), "crc32": zlib.crc32(c)} for n, c in data.items())
    assert manifest["checksummed_by"]["1"]["files"] == ["__1_0.distcp"]
    assert read_manifest(tmp_path) == manifest["files"]


def test_verification_shares_hold_each_file_once_balanced_by_bytes():
    sizes = {"__0_0.distcp": 100, "__1_0.distcp": 90, "__2_0.distcp": 80, "__3_0.distcp": 70, ".metadata": 5}
    files = {n: {"size": s, "crc32": 0} for n, s in sizes.items()}
    split = shares(files, 4)
    names = [n for share in split for n in share]
    assert sorted(names) == sorted(files) and len(names) == len(set(names))
    assert max(sum(sizes[n] for n in s) for s in split) == 100  # the largest file alone, .metadata beside 70
    assert all(s == sorted(s, key=list(files).index) for s in split)  # each in the manifest's order
    assert [len(s) for s in shares(files, 8)].count(0) == 3  # more ranks than files: some check none


def _recording(calls: list, name: str, real):
    def recorded(*a, **k):
        calls.append((name, k["process_group"]))
        return real(*a, **k)

    return recorded


def test_checkpoint_group_has_its_own_timeout(pg, tmp_path, monkeypatch):
    """Sync saves and loads run on the checkpoint's group, whose timeout is
    comm.checkpoint_timeout_seconds, untouched when the training timeout is applied after step 1."""
    made, calls = [], []

    class Recorded(Checkpointer):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            made.append(self)

    monkeypatch.setattr(train_module, "Checkpointer", Recorded)
    for name in ("save", "load"):
        monkeypatch.setattr(dcp, name, _recording(calls, name, getattr(dcp, name)))
    times = ["--comm.checkpoint_timeout_seconds=1234", "--comm.train_timeout_seconds=77"]
    for steps in (2, 3):  # the second run loads step 2
        train(tmp_path, *CKPT, f"--training.steps={steps}", "--checkpoint.interval=1", *times)
        assert pg_timeout_seconds() == 77 and pg_timeout_seconds(made[-1].pg) == 1234
    assert calls == [("save", made[0].pg), ("save", made[0].pg), ("load", made[1].pg), ("save", made[1].pg)]
    with pytest.raises(ConfigError, match=r"comm\.checkpoint_timeout_seconds: must be > 0"):
        validate(load_config(None, ["--comm.checkpoint_timeout_seconds=0"]), 1, check_files=False)


def test_progress_lines_for_a_long_save(pg, tmp_path, monkeypatch, capsys):
    """While a phase runs longer than PROGRESS_EVERY_S rank 0 says so, and a save that took longer
    is reported by phase when it is published."""
    monkeypatch.setattr(collectives, "PROGRESS_EVERY_S", 0.1)
    real = dcp.save
    monkeypatch.setattr(dcp, "save", lambda *a, **k: time.sleep(0.35) or real(*a, **k))  # a slow file system
    train(tmp_path, *CKPT, "--training.steps=1")
    out = capsys.readouterr().out
    assert len(re.findall(r"^\[checkpoint\] saving step 1: DCP write, \d+ s so far$", out, re.M)) >= 2, out
    assert re.search(
        r"^\[checkpoint\] saved step 1 in [0-9.]+ s: DCP write [0-9.]+ s, checksums [0-9.]+ s \(slowest rank 0: "
        r"[0-9.]+ s for [0-9.]+ GiB\), waiting for the other ranks' checksums [0-9.]+ s, manifest and rename",
        out,
        re.M,
    ), out


# ---------------------------------------------------------------- multi-process (slow)
def _driver(root: Path, jobs: list[tuple]) -> None:
    """tests/checkpoint_driver.py at world 4, recording the files each rank checksums; a job
    (name, overrides, expect_error) may end in a CheckpointError."""
    root.mkdir(parents=True, exist_ok=True)
    plan = {
        "root": str(root),
        "record_checksums": True,
        "jobs": [{"name": n, "overrides": [*TINY_JOB, *o], "expect_error": e} for n, o, e in jobs],
    }
    (root / "plan.json").write_text(json.dumps(plan))
    cmd = torchrun_command(4, ["-m", "tests.checkpoint_driver", str(root / "plan.json")], forked=True)
    proc = subprocess.run(cmd, cwd=ROOT, env=dist_env(4), capture_output=True, text=True, timeout=900, check=False)
    (root / "log.txt").write_text(proc.stdout + proc.stderr)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]


def _hashed(job: Path, folder: Path) -> dict[int, list[str]]:
    """rank -> names of the files of `folder` the rank checksummed during `job`."""
    out = {}
    for r in range(4):
        paths = map(Path, json.loads((job / f"checksums_rank_{r}.json").read_text()))
        out[r] = sorted(p.name for p in paths if p.parent == folder)
    return out


def _check_saved_by_writers(job: Path, steps: list[int]) -> None:
    folder = job / "checkpoint"
    assert list(complete_steps(folder)) == steps
    for step in steps:
        d = folder / f"step-{step}"
        manifest = json.loads((d / MANIFEST).read_text())
        on_disk = {p.name for p in d.iterdir()} - {MANIFEST, "titan.json"}
        assert set(manifest["files"]) == on_disk
        hashed = _hashed(job, folder / f"step-{step}.tmp")
        for r in range(4):
            own = sorted(n for n in on_disk if n.startswith(f"__{r}_") or (r == 0 and n == ".metadata"))
            assert own and manifest["checksummed_by"][str(r)]["files"] == own
            assert hashed[r] == own, (step, r, hashed[r])  # each rank its own files, once, nothing else


@pytest.mark.slow
def test_world4_each_rank_checksums_its_own_files_and_verifies_a_share(tmp_path):
    """World 4 (FSDP 4, gloo): sync and async saves, each rank checksumming only the files it
    wrote; a resume where each rank verifies its share of the files; a damaged shard written by
    another rank and verified by another rank than 0 is named on every rank and never loaded."""
    saves = tmp_path / "saves"
    _driver(
        saves,
        [
            ("sync", [*FSDP4, "--training.steps=2", "--checkpoint.interval=2"], False),
            ("async", [*FSDP4, "--training.steps=3", "--checkpoint.interval=1", *ASYNC], False),
        ],
    )
    _check_saved_by_writers(saves / "sync", [2])
    _check_saved_by_writers(saves / "async", [1, 2, 3])

    src = saves / "sync" / "checkpoint" / "step-2"
    split = shares(read_manifest(src), 4)
    victim = next(n for r in (3, 2, 1) for n in split[r] if re.match(r"__[1-9]\d*_", n))
    bad = tmp_path / "bad" / "step-2"
    shutil.copytree(src, bad)
    with open(bad / victim, "r+b") as f:  # same size, other bytes
        f.seek(64)
        f.write(bytes(b ^ 0xFF for b in f.read(4096)))
    before = digest(bad.parent)
    resumes = tmp_path / "resumes"
    _driver(
        resumes,
        [
            ("good", [*FSDP4, "--training.steps=3", f"--checkpoint.resume_from={src}"], False),
            ("bad", [*FSDP4, "--training.steps=3", f"--checkpoint.resume_from={bad}"], True),
        ],
    )
    good = json.loads((resumes / "good" / "result.json").read_text())
    assert good["start_step"] == 2
    assert _hashed(resumes / "good", src) == {r: sorted(s) for r, s in enumerate(split)}  # each its share
    for r in range(4):
        error = (resumes / "bad" / f"error_rank_{r}.txt").read_text()
        assert error.startswith(f"{bad / victim}: CRC32 mismatch at the same size"), error
    assert _hashed(resumes / "bad", bad) == {r: sorted(s) for r, s in enumerate(split)}
    assert digest(bad.parent) == before and not (resumes / "bad" / "result.json").exists()


@pytest.mark.slow
def test_scale_simulation_reports_each_rank(tmp_path):
    """scripts/checkpoint_checksum_sim.py at world 4 with small sparse shards: every rank
    checksums its own shard only, the manifest is complete and verifies, each rank's times reported."""
    out = tmp_path / "report.json"
    cmd = [sys.executable, str(ROOT / "scripts" / "checkpoint_checksum_sim.py"), "--world", "4", "--mib", "64"]
    proc = subprocess.run(
        [*cmd, "--dir", str(tmp_path / "ckpt"), "--json", str(out), "--baseline"],
        cwd=ROOT,
        env=dist_env(4),
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    report = json.loads(out.read_text())
    assert [r["rank"] for r in report["ranks"]] == [0, 1, 2, 3]
    for r in report["ranks"]:
        own = [".metadata"] * (r["rank"] == 0) + [f"__{r['rank']}_0.distcp"]
        assert r["checksummed"] == own  # its own shard only: nobody waits for a pass over all of them
        assert r["checksum_gib"] >= 64 / 1024 and r["checksum_s"] > 0 and r["checksum_cpu_s"] > 0
        assert r["gather_wait_s"] >= 0
        assert r["verify_s"] > 0 and r["verify_wait_s"] >= 0
    assert report["manifest_files"] == 5 and report["baseline_rank0_alone_s"] > 0
    assert "rank  first_read_s  checksum_s  cpu_s" in proc.stdout
