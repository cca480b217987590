"""results/dry_run.csv and results/dry_run.md from the dry-run records."""

from __future__ import annotations

import csv
import functools
import json
from importlib import resources
from pathlib import Path

import click
import tomllib
from tabulate import tabulate

from core import run_folder
from core.config import JobConfig, apply_dict
from core.dryrun import calibrate as calibrate_mod
from core.dryrun.accuracy import text as band_text
from core.dryrun.gpuspec import SpecError, load_spec
from core.dryrun.memory import ALLOCATOR_GAP_GIB, PAPER_GPU_GIB
from core.dryrun.record import predicted_record
from core.dryrun.software import parse as parse_software
from core.dryrun.stack import stack_of
from core.fileio import atomic_path, atomic_write, atomic_write_json
from recipes import launcher, paths, registry
from recipes.options import check_writable, out_dir_option, refuse
from recipes.report import compliance
from recipes.report.table_data import comparisons
from recipes.schema import TABLES

CSV_COLUMNS = (
    "recipe",
    "world_size",
    "estimated_peak_gib",
    "paper_gib",
    "bench_gib",
    "error_pct",
    "predicted_tps_per_gpu",
    "paper_tps_per_gpu",
    "tps_error_pct",
)
GOAL_PCT, GOAL_SHARE = 10.0, 0.8
TPS_GOAL_PCT, TPS_GOAL_ROWS = 15.0, 15  # predicted TPS/GPU within 15% for >= 15 of the 18 rows
EFFECT_GOAL_PP = 10.0  # every published effect: right sign, within 10 percentage points


def dry_run_rows(records: list[dict], references: dict[str, dict] | None = None) -> list[dict]:
    """One row per record: the estimate beside the paper's (and the Dec 2024 benchmark's) peak
    reserved memory; error against the paper figure."""
    if references is None:
        references = {r.id: r.reference for r in registry.all_recipes()}
    rows = []
    for rec in records:
        ref = references.get(rec["recipe"], {})
        paper, bench = ref.get("paper_mem_gib"), ref.get("bench_mem_gib")
        est = rec.get("estimated_peak_gib")
        err = round((est - paper) / paper * 100, 1) if (paper and est is not None) else None
        tps = (rec.get("predicted") or {}).get("tokens_per_sec_per_gpu")
        paper_tps = ref.get("paper_tps_per_gpu")
        tps_err = round((tps - paper_tps) / paper_tps * 100, 1) if (paper_tps and tps is not None) else None
        rows.append(
            {
                "recipe": rec["recipe"],
                "world_size": rec.get("world_size"),
                "estimated_peak_gib": est,
                "paper_gib": paper,
                "bench_gib": bench,
                "error_pct": err,
                "predicted_tps_per_gpu": None if tps is None else round(tps),
                "paper_tps_per_gpu": paper_tps,
                "tps_error_pct": tps_err,
            }
        )
    return rows


def write_dry_run_table(records: list[dict], out_dir, references: dict[str, dict] | None = None):
    """results/dry_run.csv (columns CSV_COLUMNS) and results/dry_run.md from dry-run records.
    Returns (csv path, md path)."""
    rows = dry_run_rows(records, references)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    csv_path, md_path = out / "dry_run.csv", out / "dry_run.md"
    with atomic_path(csv_path) as tmp, open(tmp, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_COLUMNS)
        w.writeheader()
        for row in rows:
            w.writerow({k: ("" if row[k] is None else row[k]) for k in CSV_COLUMNS})
    atomic_write(md_path, _markdown(rows, {r["recipe"]: r for r in records}))
    return csv_path, md_path


@functools.cache
def prose() -> dict:
    """The words of results/dry_run.md (recipes/report/templates/dry_run.toml), with placeholders."""
    text = (resources.files("recipes.report") / "templates" / "dry_run.toml").read_text(encoding="utf-8")
    return tomllib.loads(text)


def _markdown(rows: list[dict], by_id: dict[str, dict]) -> str:
    """results/dry_run.md: the memory table and its goal, the throughput section, what the fake
    step could not run, the tracker check and the terms; every word from `prose()`."""
    t = prose()
    with_ref = [r for r in rows if r["error_pct"] is not None]
    within = [r for r in with_ref if abs(r["error_pct"]) <= GOAL_PCT]
    share = len(within) / len(with_ref) if with_ref else 0.0
    goal = t["memory_goal"].format(
        goal_pct=GOAL_PCT,
        goal_share=GOAL_SHARE,
        within=len(within),
        rows=len(with_ref),
        share=share,
        verdict="met" if share >= GOAL_SHARE else "not met",
    )
    lines = [t["title"], "", t["intro"].format(allocator_gap_gib=ALLOCATOR_GAP_GIB), "", goal, ""]
    table = [_memory_row(r, by_id.get(r["recipe"], {})) for r in rows]
    lines.append(tabulate(table, headers=t["memory_headers"], tablefmt="github"))
    lines += _throughput_section(rows, by_id)
    lines += ["", t["not_run"].format(machine=_machine(by_id.values()), paper_gpu_gib=PAPER_GPU_GIB)]
    lines += _tracker_section(by_id)
    lines += ["", t["terms"], ""]
    return "\n".join(lines) + "\n"


def _memory_row(r: dict, rec: dict) -> list:
    """One row of the memory table: the estimate beside the paper's, whether the layout composed,
    what the fake step could not run, its seconds, where the peak is and what it holds."""
    b = rec.get("breakdown", {})
    parts = ", ".join(f"{k} {v:.1f}" for k, v in b.items() if v >= 0.05)
    fs = rec.get("fake_step") or {}
    not_run = sorted({**fs.get("toggles_skipped", {}), **fs.get("toggles_modelled", {})})
    est = _fmt(r["estimated_peak_gib"]) + (" (does not fit)" if rec.get("fits_gpu") is False else "")
    return [
        r["recipe"],
        r["world_size"],
        est,
        _fmt(r["paper_gib"]),
        _fmt(r["bench_gib"]),
        "" if r["error_pct"] is None else f"{r['error_pct']:+.1f}%",
        {True: "yes", False: "NO", None: "not run"}[rec.get("composes")],
        ", ".join(not_run) or "-",
        _fmt(fs.get("build_s", 0) + sum(fs.get("step_s", []))) if fs else "",
        rec.get("peak_at", ""),
        parts,
    ]


def _machine(records) -> str:
    """Where the fake steps' seconds were measured, as the records name it (`hardware.device`)."""
    t = prose()
    devices = sorted({(rec.get("hardware") or {}).get("device") for rec in records if rec.get("fake_step")} - {None})
    return t["machine_named"].format(devices="; ".join(devices)) if devices else t["machine_unnamed"]


def _tracker_section(by_id: dict[str, dict]) -> list[str]:
    """The accounting against torch's memory tracker, for the rows whose fake step ran under it."""
    t = prose()
    checks = [(rid, rec["tracker_check"]) for rid, rec in by_id.items() if rec.get("tracker_check")]
    if not checks:
        return []
    table = [
        [
            rid,
            c["tracker_allocated_gib"],
            c["accounting_eager_allocated_gib"],
            f"{c['difference_pct']:+.1f}%",
            c["note"],
        ]
        for rid, c in checks
    ]
    return [
        "",
        t["tracker_title"],
        "",
        t["tracker_intro"],
        "",
        tabulate(table, headers=t["tracker_headers"], tablefmt="github"),
    ]


def published_effects(
    predicted: dict[str, float], paper: dict[str, float], bench: dict[str, float] | None = None
) -> list[dict]:
    """The paper's published effects, paper vs predicted: each row with an `effect` label (its
    TOML file) against the row it is compared with (recipes.report.table_data.comparisons: its
    baseline, as a gain in %; in a table without baselines the previous row, as a TPS ratio
    x 100, e.g. each CP doubling). `met`: the same sign (gain > 0, ratio > 100) and within
    EFFECT_GOAL_PP of the paper, or of torchtitan's Dec 2024 re-run (`bench`) where it has both
    rows: where the two measurements disagree, either is a measurement of the effect."""
    bench = bench or {}
    out = []
    for table in TABLES:
        for new, old in comparisons(registry.by_table(table)).items():
            row = registry.get(new)
            if not row.effect or not all(k in d for d in (predicted, paper) for k in (new, old)):
                continue
            ratio = not row.baseline
            ours = _effect_size(predicted, new, old, ratio)
            measured = [_effect_size(paper, new, old, ratio)]
            if new in bench and old in bench:
                measured.append(_effect_size(bench, new, old, ratio))
            out.append(
                {
                    "effect": row.effect,
                    "paper": round(measured[0], 1),
                    "bench": round(measured[1], 1) if len(measured) > 1 else None,
                    "predicted": round(ours, 1),
                    "met": any(_effect_met(m, ours, ratio) for m in measured),
                }
            )
    return out


def bench_tps() -> dict[str, float]:
    """torchtitan's Dec 2024 re-run of the paper's rows: TPS/GPU by row id, where it has one."""
    refs = {r.id: r.reference for r in registry.all_recipes()}
    return {rid: ref["bench_tps_per_gpu"] for rid, ref in refs.items() if ref.get("bench_tps_per_gpu")}


def _effect_met(measured: float, ours: float, ratio: bool) -> bool:
    same_sign = (measured > 100) == (ours > 100) if ratio else (measured > 0) == (ours > 0)
    return same_sign and abs(ours - measured) <= EFFECT_GOAL_PP


def _effect_size(tps: dict[str, float], new: str, old: str, ratio: bool) -> float:
    """Row `new` against row `old`: the TPS ratio x 100, or the gain in %."""
    return tps[new] / tps[old] * 100 if ratio else (tps[new] / tps[old] - 1) * 100


def _throughput_section(rows: list[dict], by_id: dict[str, dict]) -> list[str]:
    """Predicted vs paper TPS/GPU per row, the goal count and where each row's step goes."""
    t = prose()
    with_ref = [r for r in rows if r["tps_error_pct"] is not None]
    if not any(r["predicted_tps_per_gpu"] is not None for r in rows):
        return []
    within = [r for r in with_ref if abs(r["tps_error_pct"]) <= TPS_GOAL_PCT]
    pred = next((by_id[r["recipe"]]["predicted"] for r in rows if by_id.get(r["recipe"], {}).get("predicted")), {})
    goal = t["throughput_goal"].format(
        goal_pct=TPS_GOAL_PCT,
        goal_rows=TPS_GOAL_ROWS,
        within=len(within),
        rows=len(with_ref),
        verdict="met" if len(within) >= TPS_GOAL_ROWS else "not met",
    )
    intro = t["throughput_intro"].format(
        gpu=pred.get("gpu", ""), calibration=pred.get("calibration", ""), band=pred.get("error_band") or band_text()
    )
    table = [_throughput_row(r, p) for r in rows if (p := (by_id.get(r["recipe"]) or {}).get("predicted"))]
    out = ["", t["throughput_title"], "", intro, "", goal, ""]
    out.append(tabulate(table, headers=t["throughput_headers"], tablefmt="github"))
    return out + _effects_section(rows)


def _throughput_row(r: dict, p: dict) -> list:
    """One row of the throughput table: predicted vs paper TPS/GPU, MFU, and the step's seconds."""
    b = p["breakdown"]
    comm = ", ".join(f"{k} {v:.2f}" for k, v in b["exposed_comm"].items() if v >= 0.005) or "-"
    return [
        r["recipe"],
        r["predicted_tps_per_gpu"],
        r["paper_tps_per_gpu"] or "",
        "" if r["tps_error_pct"] is None else f"{r['tps_error_pct']:+.1f}%",
        f"{p['mfu']:.1%}",
        f"{p['step_time_s']:.2f}",
        f"{b['compute']:.2f}",
        f"{b['memory_bound']:.2f}",
        f"{b['recompute']:.2f}",
        f"{b['bubble']:.2f}",
        comm,
    ]


def _effects_section(rows: list[dict]) -> list[str]:
    """The published effects, paper vs predicted, and the goal count."""
    t = prose()
    eff = published_effects(
        {r["recipe"]: r["predicted_tps_per_gpu"] for r in rows if r["predicted_tps_per_gpu"]},
        {r["recipe"]: r["paper_tps_per_gpu"] for r in rows if r["paper_tps_per_gpu"]},
        bench_tps(),
    )
    if not eff:
        return []
    goal = t["effects_goal"].format(goal_pp=EFFECT_GOAL_PP, met=sum(e["met"] for e in eff), effects=len(eff))
    table = [[e["effect"], e["paper"], _fmt(e["bench"]), e["predicted"], "met" if e["met"] else "missed"] for e in eff]
    return ["", goal, "", tabulate(table, headers=t["effects_headers"], tablefmt="github")]


def _fmt(v) -> str:
    return "" if v is None else f"{v:.1f}"


def records_from_dir(records_dir) -> list[dict]:
    """The dry-run records `run-recipe run ... --mode dry-run` copied to <records_dir>/dry-run/,
    in the registry's row order."""

    found = {}
    for path in sorted(Path(records_dir, "dry-run").glob("*.json")):
        rec = json.loads(path.read_text())
        found[rec.get("recipe")] = rec
    return [found[r.id] for r in registry.all_recipes() if r.id in found]


def _calibrate() -> None:
    """Refit the model's fitted constants on their public figures and print them."""
    from recipes.report import perf_validation

    click.echo(calibrate_mod.fit(perf_validation.fit_targets()))


def _validate(out_dir: Path) -> None:
    """results/perf_validation.{csv,md} and the error band (core/dryrun/accuracy.toml)."""
    from recipes.report import perf_validation

    figs = perf_validation.predict_all(perf_validation.figures())
    for path in perf_validation.write(out_dir, figs):
        click.echo(path)
    click.echo(f"error band: {perf_validation.accuracy.text()}")


def _run_all(records_dir: Path, fake: bool, gpu: str | None, software: str | None) -> None:
    """Every row's dry-run as `run-recipe run --mode dry-run [--software S]` makes it: a run folder
    with job.json and result.json (launcher.run_dry), copied atomically into <records_dir>/dry-run/."""
    settings = parse_software(software).settings() if software else []  # as DryRunMode.resolve
    for r in registry.all_recipes():
        cfg = registry.resolve_config(r, "dry-run", defaults=settings)
        run_dir = run_folder.make(r.fname, None, False, paths.default_runs_dir())
        run_folder.write_job(cfg, run_dir)
        rec = launcher.run_dry(cfg, run_dir, gpu, fake=fake, software=software)
        compliance.file_record(run_dir / "result.json", records_dir, "dry-run", r.fname)
        click.echo(f"{r.id}: {rec['estimated_peak_gib']:.1f} GiB, composes {rec['composes']}, {rec['dry_run_s']} s")


def _refresh_predictions(dest: Path, gpu_kw: dict) -> None:
    """Add (or refresh) the performance model's `predicted` in each row's record."""
    known = {r.id for r in registry.all_recipes()}
    for path in sorted(dest.glob("*.json")):
        rec = json.loads(path.read_text())
        if rec.get("recipe") not in known:
            continue
        # The record's own resolved config when it has one, else the row's.
        cfg = (
            apply_dict(JobConfig(), rec["config"], str(path))
            if rec.get("config")
            else registry.resolve_config(registry.get(rec["recipe"]), "dry-run")
        )
        # for the software the record names (core/dryrun/software.py), else this trainer's
        stack = (rec.get("software") or {}).get("stack")
        rec["predicted"] = predicted_record(cfg, **gpu_kw, **({"stack": stack_of(stack)} if stack else {}))
        atomic_write_json(path, rec, default=str)


@click.command("dry-run-table")
@click.option(
    "--records",
    "records_dir",
    type=click.Path(file_okay=False),
    default=None,
    help="Records folder (default: results/records); dry-run records are in its dry-run/.",
)
@out_dir_option("Where dry_run.csv/.md go (default: results/).")
@click.option("--all", "run_all", is_flag=True, help="Run every row's dry-run first (minutes).")
@click.option("--no-fake", is_flag=True, help="With --all: accounting only.")
@click.option(
    "--predict",
    is_flag=True,
    help="Add (or refresh) the performance model's `predicted` in the existing records first (seconds; no fake step).",
)
@click.option("--gpu", default=None, help="GPU spec for --all / --predict (default: the paper's).")
@click.option(
    "--software",
    default=None,
    help="With --all: the software the predictions speak for, as `run --mode dry-run --software` "
    "(e.g. date=2024-09, the paper's; default: this trainer's). --predict keeps each record's own.",
)
@click.option(
    "--calibrate", is_flag=True, help="Refit the model's fitted constants on their named public figures and print them."
)
@click.option(
    "--validate",
    is_flag=True,
    help="Predict every public figure (recipes/report/perf_figures.toml and the rows' references): "
    "perf_validation.{csv,md} and the error band the predictions print.",
)
def main(records_dir, out_dir, run_all, no_fake, predict, gpu, software, calibrate, validate):
    """results/dry_run.csv and .md from the dry-run records (--all first runs every row's dry-run)."""
    records_dir = Path(records_dir) if records_dir else paths.default_records_dir()
    out_dir = Path(out_dir) if out_dir else paths.results_root()
    if gpu is not None:  # before any dry-run: a misspelt spec is one line, not a traceback minutes in
        try:
            load_spec(gpu)
        except SpecError as e:
            refuse(f"error: --gpu: {e}")
    if software is not None:
        try:
            parse_software(software)
        except ValueError as e:
            refuse(f"error: {e}")
    check_writable("--out", out_dir)
    if calibrate:
        _calibrate()
        return
    if validate:
        _validate(out_dir)
    dest = records_dir / "dry-run"
    if run_all:
        _run_all(records_dir, not no_fake, gpu, software)
    if predict:
        _refresh_predictions(dest, {"gpu": gpu} if gpu else {})
    records = records_from_dir(records_dir)
    if not records:
        raise click.ClickException(f"no dry-run records under {dest}: run `run-recipe run --table <t> --mode dry-run`")
    for path in write_dry_run_table(records, out_dir):
        click.echo(path)


if __name__ == "__main__":
    main()
