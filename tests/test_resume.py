"""A run folder is a ledger: a resume says what it changes and does it (the LR schedule and the
optimizer follow this run's settings), the record keeps every step, a resume into the past moves
the later checkpoints aside, another recipe's folder is refused, a seed run saves step 0 and stops."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from core import run_folder
from recipes import launcher
from tests import fault_utils
from tests.dist_utils import ROOT
from tests.fault_utils import ROW, digest, invoke

pytestmark = pytest.mark.faults
no_spawn = fault_utils.no_spawn  # the fixture, registered in this module by name

SMALL = ("model.flavor=tiny", "training.seq_len=64", "metrics.log_freq=1", "checkpoint.enabled=true")


def _run(out: Path, *sets: str, row: str = ROW) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "recipes", "run", row, "--out", str(out)]
    for s in (*SMALL, *sets):
        cmd += ["--set", s]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=launcher.base_env(), timeout=300)


def _metrics(out: Path) -> dict[int, dict]:
    return {(r := json.loads(x))["step"]: r for x in (out / "metrics.jsonl").read_text().splitlines() if x}


@pytest.fixture(scope="module")
def extended(tmp_path_factory) -> dict:
    """A finished 3-step run extended to 6 steps, and the same 6 steps run without a stop."""
    root = tmp_path_factory.mktemp("extended")
    first = _run(root / "run", "training.steps=3", "checkpoint.interval=3")
    assert first.returncode == 0, first.stdout + first.stderr
    again = _run(root / "run", "training.steps=6", "checkpoint.interval=3")
    assert again.returncode == 0, again.stdout + again.stderr
    whole = _run(root / "whole", "training.steps=6", "checkpoint.interval=3")
    assert whole.returncode == 0, whole.stdout + whole.stderr
    return {"root": root, "again": again, "run": root / "run", "whole": root / "whole"}


@pytest.mark.slow
def test_an_extended_run_follows_the_new_schedule_and_says_so(extended):
    """Steps 4-6 use the lr an uninterrupted 6-step run uses there (the checkpoint's schedule had
    reached 0), so their losses are that run's bit for bit; one line said what changed."""
    said = extended["again"].stderr
    assert "resuming from step 3 with this run's settings from step 4 on" in said and "training.steps 3 -> 6" in said
    ours, whole = _metrics(extended["run"]), _metrics(extended["whole"])
    assert sorted(ours) == list(range(1, 7))
    for step in (4, 5, 6):
        assert ours[step]["lr"] == whole[step]["lr"] and ours[step]["loss"] == whole[step]["loss"], step
    rec = json.loads((extended["run"] / "result.json").read_text())
    assert rec["start_step"] == 3 and rec["history"]["from_step"] == 1  # the steps before the resume too
    assert rec["history"]["losses"] == [whole[s]["loss"] for s in range(1, 7)]


@pytest.mark.slow
def test_a_resume_with_another_lr_runs_and_records_it(extended):
    out = extended["run"]
    res = _run(out, "training.steps=8", "checkpoint.interval=3", "optimizer.lr=0.001")
    assert res.returncode == 0, res.stdout + res.stderr
    assert "optimizer.lr 0.0003 -> 0.001" in res.stderr or "optimizer.lr" in res.stderr
    rec = json.loads((out / "result.json").read_text())
    assert rec["config"]["optimizer"]["lr"] == 0.001
    lrs = {s: m["lr"] for s, m in _metrics(out).items()}
    # linear decay to 0 at step 8 from the new peak: step 7's lr is a fraction of 0.001 > the old 3e-4 scale
    assert lrs[7] > lrs[6] and lrs[7] <= 0.001


@pytest.mark.slow
def test_a_resume_into_the_past_moves_the_later_checkpoints_aside(extended, tmp_path):
    out = tmp_path / "run"
    res = _run(out, "training.steps=4", "checkpoint.interval=1")
    assert res.returncode == 0, res.stderr
    later = {s: digest(out / "checkpoint" / f"step-{s}") for s in (3, 4)}
    res = _run(out, "training.steps=4", "checkpoint.interval=1", "checkpoint.load_step=2")
    assert res.returncode == 0, res.stderr
    assert "later checkpoints were moved aside" in res.stdout + res.stderr
    aside = sorted((out / "checkpoint").glob("step-*.superseded-*"))
    assert [p.name.split(".")[0] for p in aside] == ["step-3", "step-4"]
    assert [digest(p) for p in aside] == [later[3], later[4]]  # kept as they were
    assert (out / "checkpoint" / "step-4").is_dir()  # saved again by this run


@pytest.mark.slow
def test_a_seed_checkpoint_run_saves_step_0_and_stops(tmp_path):
    out = tmp_path / "seed"
    res = _run(out, "training.steps=5", "checkpoint.create_seed_checkpoint=true")
    assert res.returncode == 0, res.stdout + res.stderr
    assert sorted(p.name for p in (out / "checkpoint").iterdir()) == ["step-0"]
    rec = json.loads((out / "result.json").read_text())
    assert rec["losses"] == [] and "seed checkpoint" in res.stdout
    res = _run(out, "training.steps=5", "checkpoint.create_seed_checkpoint=true")  # a seed over a checkpoint
    assert res.returncode == 2 and "already holds checkpoints" in res.stderr


def test_another_recipes_folder_is_refused(tmp_path, no_spawn):
    """A folder that holds another recipe's run is neither resumed nor overwritten."""
    out = tmp_path / "run"
    out.mkdir()
    (out / "job.json").write_text(json.dumps({"job": {"recipe": "llama3_8b/table1/8gpu_fsdp_compile"}}))
    (out / "result.json").write_text('{"the": "only record of that run"}')
    before = digest(out)
    res = invoke("run", ROW, "--out", str(out))
    assert res.exit_code == 2, res.output
    assert "holds a run of llama3_8b/table1/8gpu_fsdp_compile" in res.output and "checkpoint.resume_from" in res.output
    assert digest(out) == before and not (out / run_folder.LOCK).exists()


def test_a_resume_that_would_read_other_data_is_refused(tmp_path, no_spawn):
    """The checkpoint's loader position is in its own corpus: another data.path is refused by name."""
    ckpt = tmp_path / "run" / "checkpoint" / "step-2"
    ckpt.mkdir(parents=True)
    (ckpt / ".metadata").write_bytes(b"")
    cfg = {"data": {"path": "/somewhere/else"}, "training": {"steps": 2}}
    (ckpt / "titan.json").write_text(json.dumps({"step": 2, "kind": "full", "config": cfg}))
    res = invoke("run", ROW, "--out", str(tmp_path / "run"), "--set", "checkpoint.enabled=true")
    assert res.exit_code == 2, res.output
    assert "data.path: '/somewhere/else' in the checkpoint at step 2" in res.output
