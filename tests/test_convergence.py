"""Loss convergence: the check on curves (fast, hand-made records), and the regression test that
re-runs the first PREFIX_STEPS steps of each row through the launcher and compares them with the
golden curves (results/golden/loss_convergence.json, written by `run-recipe convergence`)."""

from __future__ import annotations

import copy
import json
import math
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from recipes import registry
from recipes.report import loss_curves as curves
from recipes.studies import convergence as conv

pytestmark = pytest.mark.dryrun

IDS = [r.id for r in curves.rows()]
BASE = curves.control().id


def _records(offsets: dict[str, float], steps: int = 200, noise: float = 0.1) -> dict[str, dict]:
    """A decaying loss with deterministic batch noise shared by every layout, plus a per-row offset
    (and a small per-row jitter) from step 1 on."""
    recs = {}
    for k, r in enumerate(curves.rows()):
        cfg = r.job_config("proxy").to_dict()
        cfg["training"]["steps"] = steps
        base = [8.3 * math.exp(-i / 40) + 4.0 + noise * math.sin(7.3 * i) for i in range(steps)]
        jitter = [0.01 * math.sin(3.1 * i + k) for i in range(steps)]
        off = offsets.get(r.id, 0.0)
        recs[r.id] = {
            "recipe": r.id,
            "mode": "proxy",
            "config": cfg,
            "world_size": 2,
            "losses": [b + j + off for b, j in zip(base, jitter, strict=True)],
            "versions": {"torch": "x"},
            "hardware": {"device": "cpu"},
            "wall_s": 1.0,
        }
    return recs


def test_rows_share_global_batch_and_token_order():
    """The premise of comparing curves: same dp degree, local batch, seq, steps, schedule, data."""
    cfgs = {rid: registry.get(rid).job_config("proxy") for rid in IDS}
    for rid, cfg in cfgs.items():
        assert not curves.comparable({"config": cfg.to_dict()}, {"config": cfgs[BASE].to_dict()}), rid
        assert cfg.training.steps >= 500 and cfg.training.mixed_precision_param == "bfloat16"
        assert cfg.training.mixed_precision_reduce == "float32" and cfg.data.dataset == "c4_offline"
        assert cfg.lr_scheduler.warmup_steps * 5 == cfg.training.steps
    four_d = cfgs["llama3_8b/loss_convergence/4d_fsdp8_tp2_pp2_cp2"].parallelism
    assert (four_d.dp_shard, four_d.tp, four_d.pp, four_d.cp, four_d.pp_schedule) == (2, 2, 2, 2, "Interleaved1F1B")


def test_check_passes_within_tolerance_and_fails_on_an_offset():
    nd = [rid for rid in IDS if rid != BASE]
    ok = curves.check(_records({nd[0]: 0.02}))
    assert [r["status"] for r in ok] == ["pass"] * 3
    off = {r["recipe"]: r for r in ok}[nd[0]]
    assert off["mean_abs_diff_smoothed"] == pytest.approx(0.02, abs=0.01)
    bad = {r["recipe"]: r for r in curves.check(_records({nd[1]: 3 * curves.TOLERANCE}))}
    assert bad[nd[1]]["status"] == "FAIL" and bad[nd[1]]["passed"] is False
    assert bad[nd[1]]["mean_abs_diff_smoothed"] == pytest.approx(3 * curves.TOLERANCE, rel=0.2)
    assert bad[nd[0]]["passed"] and bad[nd[2]]["passed"]


def test_check_refuses_incomparable_or_missing_records():
    recs = _records({})
    changed = copy.deepcopy(recs)
    changed[IDS[1]]["config"]["training"]["local_batch_size"] = 8  # a different global batch
    res = {r["recipe"]: r for r in curves.check(changed)}
    assert res[IDS[1]]["passed"] is False and "training.local_batch_size" in res[IDS[1]]["status"]
    del recs[IDS[2]]
    res = {r["recipe"]: r for r in curves.check(recs)}
    assert res[IDS[2]]["status"] == "no record" and res[IDS[2]]["passed"] is None


def test_outputs_csv_png_and_markdown(tmp_path):
    files, md = curves.write_outputs(_records({}), tmp_path)
    assert {p.name for p in files} == {"loss_convergence.csv", "loss_convergence.png"}
    df = pd.read_csv(tmp_path / "loss_convergence.csv")
    assert list(df.columns) == ["step"] + [curves.column(rid) for rid in IDS]
    assert df["step"].tolist() == list(range(1, 201))
    assert (tmp_path / "loss_convergence.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"tolerance {curves.TOLERANCE:g} nats" in md and "3 of 3 N-D layouts within tolerance" in md


def test_check_lists_each_skipped_toggle_once_under_its_table():
    """A toggle skipped in several rows, for one reason, is one line under the check's table
    naming the rows (it was a wide column repeating the reason per row)."""
    recs = _records({})
    why = "AsyncTP needs CUDA GPUs"
    nd = [rid for rid in IDS if rid != BASE]
    for rid in nd[:2]:
        recs[rid]["toggles_skipped"] = {"async_tp": why}
    md = curves.markdown(recs, curves.check(recs))
    assert md.count(why) == 1
    assert f"- async_tp: {why} ({curves.column(nd[0])}, {curves.column(nd[1])})" in md
    assert "toggles skipped" not in md


@pytest.mark.parametrize("steps", [10, 200])
def test_plot_shows_every_run_and_every_point(steps):
    """The loss panel and the difference panel (each N-D run minus the control) span every point
    drawn on them, a 10-step run's first steps included; each run has its own style and marker,
    so runs that overlap, as they should, all show."""
    recs = _records({IDS[1]: 0.02}, steps=steps)
    fig = curves.figure(recs, curves.check(recs))
    try:
        loss, diff = fig.axes
        assert "− 1D" in diff.get_ylabel()
        for ax in (loss, diff):
            (x0, x1), (y0, y1) = ax.get_xlim(), ax.get_ylim()
            data = [line for line in ax.get_lines() if line.get_transform() is ax.transData]
            for line in data:
                x, y = np.asarray(line.get_xdata(), float), np.asarray(line.get_ydata(), float)
                assert ((x0 <= x) & (x <= x1)).all() and ((y0 <= y) & (y <= y1)).all(), (ax.get_ylabel(), steps)
        runs = [line for line in loss.get_lines() if not line.get_label().startswith("_")]
        assert len(runs) == len(IDS) and len({(ln.get_linestyle(), ln.get_marker()) for ln in runs}) == len(IDS)
        shifted = [line for line in diff.get_lines() if line.get_transform() is diff.transData]
        assert len(shifted) == len(IDS) - 1  # one difference per N-D run
        assert any(np.nanmean(line.get_ydata()) == pytest.approx(0.02, abs=0.01) for line in shifted)
    finally:
        curves.plt.close(fig)


def test_prefix_stays_inside_warmup():
    assert conv.prefix_overrides()[0] == f"training.steps={conv.PREFIX_STEPS}"
    warmup = curves.control().job_config("proxy").lr_scheduler.warmup_steps
    with pytest.raises(ValueError, match="warmup"):
        conv.prefix_overrides(warmup + 1)


def test_resumed_run_is_stitched_from_metrics_and_checked(tmp_path):
    """A run killed after step 6 and resumed from its step-4 checkpoint: the record holds steps 5..8,
    metrics.jsonl every attempt's steps; the stitched record has steps 1..8, replays must agree."""
    logged = [(s, 9.0 - 0.1 * s) for s in range(1, 7)] + [(s, 9.0 - 0.1 * s) for s in range(5, 9)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": v}) + "\n" for s, v in logged))
    rec = {"recipe": IDS[1], "start_step": 4, "losses": [9.0 - 0.1 * s for s in range(5, 9)]}
    out = conv._stitch(tmp_path, rec, attempts=2)
    assert out["losses"] == [9.0 - 0.1 * s for s in range(1, 9)] and out["start_step"] == 0
    assert out["resumed"]["replayed_steps_max_abs_diff"] == 0.0 and out["resumed"]["last_start_step"] == 4
    base = {"recipe": BASE, "config": {}, "losses": out["losses"]}
    assert not curves.comparable({**out, "config": {}}, base)
    # an inexact resume (replayed steps differ) makes the curve incomparable
    (tmp_path / "metrics.jsonl").write_text(
        (tmp_path / "metrics.jsonl").read_text() + json.dumps({"step": 6, "loss": 8.0}) + "\n"
    )
    bad = conv._stitch(tmp_path, rec, attempts=2)
    assert any("resumed inexactly" in w for w in curves.comparable({**bad, "config": {}}, base))


# ------------------------------------------------------------------------- golden regression
GOLDEN = conv.golden_path()


@pytest.mark.slow
@pytest.mark.parametrize("rid", IDS)
def test_prefix_matches_golden(rid, tmp_path):
    """Re-run the first PREFIX_STEPS steps of the row (the same config as the golden run; the LR in
    warmup does not depend on training.steps) and compare per step with the golden curve."""
    if not GOLDEN.is_file() or rid not in json.loads(GOLDEN.read_text())["rows"]:
        # The golden curves come only from the full 500-step runs (`run-recipe convergence`);
        # until they are committed there is nothing to regress against.
        pytest.skip(f"{GOLDEN.name} has no golden curve for {rid}: run `run-recipe convergence`")
    golden = json.loads(GOLDEN.read_text())
    # a golden file may hold a longer prefix than the test re-runs: its first PREFIX_STEPS are compared
    k, tol = min(golden["prefix_steps"], conv.PREFIX_STEPS), golden["prefix_tolerance"]
    assert tol <= conv.PREFIX_TOLERANCE
    gold = golden["rows"][rid]["losses"][:k]
    t0 = time.perf_counter()
    rec, _ = conv.run_row(registry.get(rid), conv.prefix_overrides(k), run_dir=tmp_path / "run", echo=False)
    diff = max(abs(a - b) for a, b in zip(rec["losses"], gold, strict=False))
    print(
        f"{rid}: {k} steps in {time.perf_counter() - t0:.0f} s, max |Δ| vs golden {diff:.2e} "
        f"(tolerance {tol:g}; golden made with {golden['versions']})"
    )
    assert len(rec["losses"]) == k
    assert rec["toggles_applied"] == golden["rows"][rid]["toggles_applied"]
    assert diff <= tol, (
        f"{rid}: first {k} losses drift {diff:.2e} > {tol:g} from the golden curve\n"
        f"ours   {rec['losses']}\ngolden {gold}"
    )


# ------------------------------------------------------------------ the command: folders, resume
ROW_1D = "llama3_8b/loss_convergence/1d_fsdp8"
FNAME_1D = ROW_1D.replace("/", "__")


@pytest.fixture
def fake_trainer(monkeypatch):
    """launcher.run_logged as a trainer that writes the record of the job it is given; `then`
    (a callable of the run folder) runs first and may fail the launch (return an exit code)."""
    from recipes import launcher

    shipped = json.loads((conv.paths.results_root() / "records" / "proxy" / f"{FNAME_1D}.json").read_text())
    calls = {"then": None, "n": 0}

    def run_logged(cmd, env, log, echo=False, **kw):
        job = json.loads(Path(cmd[cmd.index("--config") + 1]).read_text())
        run_dir, steps = Path(job["job"]["output_dir"]), job["training"]["steps"]
        calls["n"] += 1
        rc = calls["then"](run_dir) if calls["then"] else None
        if rc:
            return rc
        losses = [9.0 - 0.01 * s for s in range(steps)]
        rec = {**shipped, "config": job, "steps": steps, "losses": losses, "start_step": 0}
        (run_dir / "result.json").write_text(json.dumps(rec))
        return 0

    monkeypatch.setattr(launcher, "run_logged", run_logged)
    return calls


def _convergence(*args):
    from click.testing import CliRunner

    return CliRunner().invoke(conv.convergence, ["--steps", "10", "--only", "1d_fsdp8", *args])


def test_out_is_the_root_of_the_run_folders_and_only_its_own_files_are_written(tmp_path, fake_trainer):
    out = tmp_path / "out"
    res = _convergence("--out", str(out))
    assert res.exit_code == 0, res.output
    assert (out / "runs" / FNAME_1D / "job.json").is_file() and (
        out / "records" / "proxy" / f"{FNAME_1D}.json"
    ).is_file()
    written = {p.name for p in out.iterdir()}
    assert written <= {
        "runs",
        "records",
        "loss_convergence.md",
        "loss_convergence.csv",
        "loss_convergence_table.csv",
        "loss_convergence.png",
    }, written
    assert "loss_convergence.md" in written and not list(out.glob("table*"))


@pytest.mark.faults
def test_an_interrupted_run_resumes_and_another_run_is_refused(tmp_path, fake_trainer):
    from tests.fault_utils import digest

    out = tmp_path / "out"
    run_dir = out / "runs" / FNAME_1D

    def dies(run_dir):  # a checkpoint written, then the trainer dies: every attempt
        (run_dir / "checkpoint").mkdir(exist_ok=True)
        (run_dir / "checkpoint" / "kept").write_text("written by the first run\n")
        return 1

    fake_trainer["then"] = dies
    assert _convergence("--out", str(out)).exit_code == 1

    def resumes(run_dir):
        assert (run_dir / "checkpoint" / "kept").is_file(), "the interrupted run's folder was emptied"

    fake_trainer["then"] = resumes
    res = _convergence("--out", str(out))
    assert res.exit_code == 0, res.output
    n = fake_trainer["n"]
    assert _convergence("--out", str(out)).exit_code == 0 and fake_trainer["n"] == n  # finished: reused
    before = digest(run_dir)
    res = _convergence("--out", str(out), "--steps", "20")  # another run in the same folder
    assert res.exit_code == 2, res.output
    assert "training.steps 10 there, 20 here" in res.output and len(res.output.strip().splitlines()) == 1
    assert digest(run_dir) == before and fake_trainer["n"] == n


@pytest.mark.faults
def test_sigterm_stops_convergence_and_says_how_to_resume(tmp_path, fake_trainer):
    import os
    import signal

    class NotHeard(BaseException):
        pass

    def unheard(signum, frame):
        raise NotHeard("SIGTERM reached the default handler: the command does not handle it")

    fake_trainer["then"] = lambda run_dir: os.kill(os.getpid(), signal.SIGTERM)
    previous = signal.signal(signal.SIGTERM, unheard)
    try:
        res = _convergence("--out", str(tmp_path / "out"))
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert res.exit_code == 128 + signal.SIGTERM, res.output
    assert "stopped by SIGTERM" in res.output and "resume" in res.output
    assert not (tmp_path / "out" / "runs" / FNAME_1D / ".run.lock").exists()
