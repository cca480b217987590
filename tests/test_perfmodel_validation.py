"""The validation's bands and held-out split (core/dryrun/accuracy.py, recipes/report/perf_validation.py,
recipes/report/memory_validation.py): the band of a kind of run, the figures issue 35 added and their
roles, the memory page."""

from __future__ import annotations

import csv
import functools
from pathlib import Path

import pytest

from core.dryrun import gpuspec as G
from recipes import registry

ROOT = Path(__file__).resolve().parents[1]
T1_COMP = "llama3_8b/table1/8gpu_fsdp_compile"


def cfg_with(rid: str, *overrides: str):
    return registry.resolve_config(registry.get(rid), "dry-run", list(overrides))


@functools.cache
def _validated():
    from recipes.report import perf_validation as V

    return V, V.predict_all(V.figures())


def test_band_of_a_kind_widens_where_fewer_than_a_handful_back_it():
    """A kind with a handful of figures prints their own error; one with fewer says how many,
    widens by dropping the kind's fields in order, and is never narrower than its own figures."""
    from core.dryrun import accuracy

    base = {"gpu": "g", "precision": "bf16", "compile": "eager", "ac": "op SAC", "pp": False, "cp": False}

    def fig(err, **kw):
        return {**base, **kw, "error_pct": err}

    judged = [fig(2.0)] * 5 + [fig(-30.0, ac="no AC")] + [fig(4.0, ac="full AC")] * 5
    b = accuracy.kind_band(base, judged)
    assert (b["figures"], b["own"], b["mae"]) == (5, 5, 2.0)
    lone = {**base, "ac": "no AC"}
    b = accuracy.kind_band(lone, judged)
    assert b["own"] == 1 and b["figures"] == 11 and "ac" not in b["over"]
    assert b["mae"] == 30.0 and b["worst"] == -30.0  # its own figure's error, wider than the group's
    none = {**base, "gpu": "other", "precision": "Float8 tensorwise"}
    b = accuracy.kind_band(none, judged)
    assert b["own"] == 0 and b["over"] == [] and b["figures"] == 11
    s = {"mean_abs_error_pct": 5.0, "figures": 11, "worst_pct": -30.0, "judged": judged}
    assert "only 1 public figure of its kind" in accuracy.text(s, kind=lone) and "widened to the 11" in accuracy.text(
        s, kind=lone
    )
    assert "over the 5 public figures of its kind" in accuracy.text(s, kind=base)


# Issue 52's sources: the figures seen while its mechanisms were built are "prior" (no role), the
# ones it names "listed"; the MI300X run arrived after and is held out.
ISSUE_52_SOURCES = ("tt364", "tt642", "tt1207", "tt1185", "tt1881", "tt773", "torchao-float8-mi300x")


def test_issue_52_figures_say_what_they_were_used_for():
    """Every figure of issue 52's sources is prior, listed (naming what for) or held out, and a
    reading its own source contradicts is shown apart with the reason, never judged."""
    from recipes.report import memory_validation

    V, figs = _validated()
    ours = [f for f in V.data()["figures"] if f["source"] in ISSUE_52_SOURCES]
    assert len(ours) >= 15
    assert all(f.get("role", "prior") in ("prior", "listed", "held_out") for f in ours)
    assert all(f.get("designed_for") for f in ours if f.get("role") == "listed")
    apart = {f.id for f in figs if f.memory_outside}
    assert {"aws-p5/8b-32-eager", "aws-p5/8b-32-compile"} <= apart
    assert not apart & {f.id for f in memory_validation.judged(figs)}
    judged_tp = [f for f in memory_validation.judged(figs) if f.cfg.parallelism.tp > 1]
    judged_pp = [f for f in memory_validation.judged(figs) if f.cfg.parallelism.pp > 1]
    assert len(judged_tp) >= 5 and len(judged_pp) >= 3


def test_held_out_figures_are_recorded_and_judged_apart():
    """Every figure issue 35 added says whether a mechanism was designed against it (`listed`,
    naming which) or it is held out; the held-out summary is the error over exactly those, and
    a Float8 eager or no-float8-all-gather prediction prints a band drawn from its own kind."""
    from core.dryrun import accuracy

    V, figs = _validated()
    before = ("asynctp-2506", "torchao-float8", "torchtitan-808", "aws-p5", "trainy-h200", "torchao-b200")
    new = [f for f in V.data()["figures"] if f["source"] not in before + ISSUE_52_SOURCES]
    assert new and all(f.get("role") in ("listed", "held_out") for f in new)
    assert all(f.get("designed_for") for f in new if f["role"] == "listed")
    assert not any(f.get("designed_for") for f in new if f["role"] == "held_out")
    s = V.summary(figs)
    held = [f for f in V.judged(figs) if f.role == "held_out"]
    assert s["held_out"]["figures"] == len(held) >= 15
    assert s["held_out"]["mean_abs_error_pct"] == pytest.approx(
        sum(abs(f.error_pct) for f in held) / len(held), abs=0.05
    )
    stored = accuracy.band()  # what the predictions read: every judged figure's kind, top level
    assert {j["id"] for j in stored["judged"]} == {f.id for f in V.judged(figs)} and stored["held_out"][
        "figures"
    ] == len(held)
    eager = cfg_with(T1_COMP, "compile.enabled=false", "float8.enabled=true")
    for cfg, precision in (
        (eager, "Float8 tensorwise"),
        (cfg_with(T1_COMP, "float8.enabled=true"), "Float8 tensorwise"),
    ):
        kind = accuracy.kind_of(cfg, G.DEFAULT_GPU)
        assert kind["precision"] == precision
        b = accuracy.kind_band(kind, s["judged"])
        assert b["own"] >= 1 and "precision" in b["over"]  # drawn from figures of its precision
        assert describe_in(accuracy.text(s, kind=kind), kind)


def describe_in(text: str, kind: dict) -> bool:
    from core.dryrun import accuracy

    return f"of its kind ({accuracy.describe_kind(kind)})" in text


def test_memory_results_are_the_validation_of_this_model():
    """results/memory_validation.csv is what the harness writes for the accounting today: every
    judged memory reading, its prediction and error; readings shown apart are not in it."""
    from recipes.report import memory_validation as M

    V, figs = _validated()
    with open(ROOT / "results" / "memory_validation.csv", newline="") as fh:
        stored = list(csv.DictReader(fh))
    fresh = {r["source"]: r for r in M.csv_rows(figs)}
    assert tuple(stored[0]) == M.CSV_COLUMNS and set(fresh) == {r["source"] for r in stored}
    for r in stored:
        assert float(r["predicted_reserved_gib"]) == pytest.approx(
            fresh[r["source"]]["predicted_reserved_gib"], abs=0.02
        )
    apart = [f for f in figs if f.measured_reserved is not None and f.memory_outside]
    assert apart and not {f.id for f in apart} & set(fresh)
    s = V.summary(figs)
    assert s["memory"]["figures"] == len(fresh) >= 60
    assert {"h100_96gb_hbm2e_500w", "h200_141gb"} <= set(s["memory_gpus"])


def test_plan_shows_each_candidates_band_and_breaks_no_tie_within_it():
    """`run-recipe plan` gives each candidate the band of its kind; candidates predicted within
    their band of the fastest are a tie the model cannot break: they lead, in the rules' order."""
    import json

    from click.testing import CliRunner

    from core.dryrun import accuracy
    from recipes.cli import main

    # the paper's 95 GiB: there FSDP 4 x TP 2 fits without AC, with its memory band, beside FSDP 8
    args = ["plan", "--model", "8B", "--gpus", "8", "--local-batch", "2", "--gpu-mem", "95", "--json"]
    res = CliRunner().invoke(main, args, catch_exceptions=False)
    assert res.exit_code == 0, res.output
    ranked = json.loads(res.output)
    assert accuracy.band()["judged"]
    assert all(r["error_band_pct"] is not None for r in ranked)
    fit = [r for r in ranked if r["fits"] and not r["violations"]]
    top = max(fit, key=lambda r: r["tokens_per_sec_per_gpu"])
    ties = [
        r
        for r in fit
        if r["tokens_per_sec_per_gpu"]
        >= top["tokens_per_sec_per_gpu"] * (1 - max(top["error_band_pct"], r["error_band_pct"], 3) / 100)
    ]
    assert [r["rank"] for r in ties] == list(range(1, len(ties) + 1))  # the tie leads the ranking
    assert len(ties) > 1  # FSDP 8 and FSDP 4 x TP 2 within a band of each other
    assert ranked[0]["layout"] == "FSDP 8"  # the rules, not the model, order a tie: FSDP first
