"""Regenerates `results/` from the result records only.

Records live in `<records_dir>/<mode>/<id__>.json` (mode: real, proxy, dry-run), one per recipe
and mode, the latest run's. Each table gets `<table>.md` and `<table>.csv`: one line per paper
row, the paper (and bench-2412) figures from the recipe files beside the dry-run's prediction
and memory and our proxy's (or real) figures. The CSV has every column; the .md a compact table,
the provenance under it and the figure (`<table>.png`, recipes/report/figures.py); the numbers come from
recipes/report/table_data.py. A cell with no record is empty. `README.md` indexes the tables, the other
results files when present, and says how each number was made.

The loss-convergence table is the exception in naming: `loss_convergence.csv` holds the curves
(step x row, recipes/report/loss_curves.py), so its table goes to `loss_convergence_table.csv`, and
`loss_convergence.md` carries the table, the curves' check and a link to the plot.
"""

from __future__ import annotations

import csv
import functools
import math
from importlib import resources
from pathlib import Path
from typing import Any

import pandas as pd
import tomllib

from core.fileio import atomic_path, atomic_write, remove_leftovers
from recipes import registry
from recipes.paths import relative
from recipes.report import compliance, figures, loss_curves
from recipes.report.table_data import NoRecordsError, load_records, markdown_table, predicted_part, table_frame
from recipes.schema import TABLES, Recipe


# ------------------------------------------------------------------------------- CSV files
def read_csv(path: str | Path) -> list[dict[str, str]]:
    """The rows of a CSV file as dicts of strings; [] when there is no file."""
    path = Path(path)
    if not path.is_file():
        return []
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def write_csv(path: str | Path, rows: list[dict], columns: list[str] | tuple[str, ...]) -> Path:
    """Every CSV the harness writes besides the pandas tables: `columns` in order (other keys of a
    row are left out; None is an empty cell), written to a temporary file and renamed, so a
    reader never sees half a file."""
    with atomic_path(path) as tmp, open(tmp, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(columns), extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    return Path(path)


def table_csv_name(table: str) -> str:
    return "loss_convergence_table.csv" if table == "loss_convergence" else f"{table}.csv"


def _fmt_cell(col: str, value: Any, approx: bool = False) -> str:
    if value is None or value is pd.NA or (isinstance(value, float) and math.isnan(value)):
        return ""
    if col.endswith("gain %"):
        return f"{value:+.2f}%"
    if col.endswith("error %"):
        return f"{value:+.1f}%"
    if "TPS" in col:
        return f"{value:,.0f}" if value >= 100 else f"{value:,.3g}"
    if "mem GiB" in col:
        return ("~" if approx else "") + f"{value:.1f}" if value >= 1 else f"{value:.3f}"
    if col in ("ours MFU %", "ours PP bubble %", "predicted MFU %"):
        return f"{value:.1f}"
    if "loss" in col:
        return f"{value:.4f}" if "Δ" not in col else f"{value:.2e}"
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


# The compact table of a paper table (its .md): these columns of the frame, renamed for the eye.
COMPACT = {
    "row": "row",
    "paper TPS/GPU": "paper TPS/GPU",
    "predicted TPS/GPU": "predicted TPS/GPU",
    "predicted TPS error %": "TPS error %",
    "paper gain %": "paper gain %",
    "predicted gain %": "predicted gain %",
    "paper mem GiB": "paper mem GiB",
    "dry-run est. mem GiB": "dry-run mem GiB",
    "dry-run mem error %": "mem error %",
    "ours TPS/device": "ours TPS/device",
    "ours gain %": "ours gain %",
}


def to_markdown(df: pd.DataFrame, recipes: list[Recipe], compact: bool | dict[str, str] = False) -> str:
    """Every column of the frame, or (compact) the few of COMPACT (or of the mapping given) a
    person can read, renamed, the rest being in the CSV and the list under the table; numbers
    right-aligned, text left; a calibration row's prediction gets †."""
    names = COMPACT if compact is True else compact or {}
    approx = {r.id: bool(r.reference.get("paper_mem_approx")) for r in recipes}
    cols = [c for c in (names if compact else df.columns) if c in df.columns]
    shown = pd.DataFrame(
        {
            c: [
                _fmt_cell(c, v, approx.get(rid, False) and c == "paper mem GiB")
                for v, rid in zip(df[c], df["recipe"], strict=True)
            ]
            for c in cols
        }
    )
    if compact and "predicted TPS/GPU" in cols:
        shown["predicted TPS/GPU"] = [
            f"{v} †" if v and isinstance(cal, str) else v
            for v, cal in zip(shown["predicted TPS/GPU"], df["calibrated on"], strict=True)
        ]
    right = [bool(compact) and not any(isinstance(v, str) for v in df[c]) for c in cols[1:]]
    return markdown_table(shown.rename(columns=names), colalign=["left"] + ["right" if r else "left" for r in right])


def _rows_by(labels, values) -> list[str]:
    """`(the rows, or all rows): value` for each non-empty value, first seen first."""
    out: dict[str, list[str]] = {}
    for row, value in zip(labels, values, strict=True):
        if isinstance(value, str) and value:
            out.setdefault(value, []).append(row)
    return [f"({'all rows' if len(rows) == len(labels) else '; '.join(rows)}): {v}" for v, rows in out.items()]


def _band(preds: list[dict]) -> str:
    """The error band the records' predictions carry (core/dryrun/accuracy.py), else today's."""
    from core.dryrun import accuracy

    bands = sorted({p["error_band"] for p in preds if p.get("error_band")})
    return "; ".join(bands) if bands else accuracy.text()


def _software(df: pd.DataFrame, records: dict) -> str:
    """The software the rows' predictions speak for, as their records name it."""
    recs = [records.get((rid, "dry-run")) for rid in df["recipe"]]
    texts = [(rec.get("software") or {}).get("text") for rec in recs if predicted_part(rec)]
    named = sorted({t for t in texts if t})
    unnamed = "software not named (a record older than core/dryrun/software.py)"
    return "; ".join(named + ([unnamed] if None in texts or "" in texts else []))


def provenance_lines(df: pd.DataFrame, recipes: list[Recipe], records: dict, fig: str | None) -> list[str]:
    """The short list under a compact table: the GPU spec and calibration of the predictions,
    the mode, hardware, versions and notes of our records, the recipe ids and the figure."""
    n = len(df)
    preds = [predicted_part(records.get((rid, "dry-run"))) for rid in df["recipe"]]
    gpus = sorted({p["gpu"] for p in preds if p.get("gpu")})
    notes = sorted({p["calibration"] for p in preds if p.get("calibration")})
    n_pred = int(df["predicted TPS/GPU"].notna().sum())
    lines = []
    if n_pred:
        lines.append(
            f"- **predicted** ({n_pred} of {n} rows): the performance model (`core/dryrun/runtime.py`) "
            f"on the GPU spec {', '.join(f'`{g}`' for g in gpus)} (`core/dryrun/hardware/`), from "
            f"each row's dry-run record, for {_software(df, records)}; `TPS error %` and `mem error %` are "
            f"against the paper. The model's measured error band: {_band(preds)}."
        )
        cal = [
            f"{row} ({const})"
            for row, const in zip(df["row"], df["calibrated on"], strict=True)
            if isinstance(const, str)
        ]
        lines.append(
            "- **calibration**: "
            + "; ".join(notes)
            + ". "
            + (
                f"Calibration row here (†): {'; '.join(cal)}; every other row is a prediction."
                if cal
                else "No row of this table was used: every figure here is a prediction."
            )
        )
        unfit = list(df.loc[df["predicted fits GPU"].eq(False).fillna(False).astype(bool), "row"])
        if unfit:
            lines.append(f"- **does not fit its GPU** (predicted anyway): {'; '.join(unfit)}")
    else:
        lines.append("- **predicted**: no dry-run record with a prediction (`run-recipe run ID --mode dry-run`).")
    if "gain of" in df and any(r.baseline for r in recipes):
        lines.append(
            "- **gains** over the row's baseline: "
            + "; ".join(
                f"{row} adds {g}" for row, g in zip(df["row"], df["gain of"], strict=True) if isinstance(g, str)
            )
        )
    elif "gain of" in df:
        lines.append("- **gains**: each row over the previous one (`gain of` in the CSV says what changes)")
    prov = [
        ", ".join(x for x in t if isinstance(x, str) and x)
        for t in zip(df["ours mode"], df["ours hardware"], df["ours versions"], strict=True)
    ]
    lines += [f"- **ours** {x}" for x in _rows_by(list(df["row"]), prov)]
    lines += [f"- **notes** {x}" for x in _rows_by(list(df["row"]), df["ours notes"])]
    lines.append("- **recipes**: " + ", ".join(f"`{rid}`" for rid in df["recipe"]))
    if fig:
        lines += ["", f"![paper vs predicted TPS/GPU and the predicted step breakdown]({fig})"]
    return lines


# ---------------------------------------------------------------------------------- writing


@functools.cache
def prose() -> dict:
    """The prose results/ prints (recipes/report/templates/results_readme.toml): README intro, table
    footers, how each number was made, what the other results files are."""
    template = resources.files("recipes.report") / "templates" / "results_readme.toml"
    return tomllib.loads(template.read_text(encoding="utf-8"))


def table_records(records_dir: str | Path, skipped: list[str] | None = None, include_deviating: bool = False):
    """(records the tables may show, a line for each record not counted): the records of the
    folder that parse (table_data.load_records), kept when they conform (recipes/report/compliance.py)."""
    return compliance.counted(load_records(records_dir, skipped), include_deviating)


def write_results(
    records_dir: str | Path, out_dir: str | Path, skip_bad_records: bool = False, include_deviating: bool = False
) -> list[Path]:
    """Write every table (.md + .csv) and README.md into out_dir. Returns the files written.
    A bad record raises RecordError before anything is written; with `skip_bad_records` it is
    left out, and the tables and README say which and why. A record that is not a conforming run
    of its row is left out and listed (`include_deviating`: shown, marked). A folder with no
    usable record raises NoRecordsError, also before anything is written: its tables would be blank."""
    skipped: list[str] | None = [] if skip_bad_records else None
    records, not_counted = table_records(records_dir, skipped, include_deviating)
    if not records and not not_counted:
        raise NoRecordsError(f"{records_dir}: no usable record ({len(skipped or [])} skipped as bad)")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    remove_leftovers(out)  # the temporary files of a run killed mid-write (core/fileio.py)
    info = registry.table_info()
    written: list[Path] = []
    index = []
    left = {"skipped_records": skipped or [], "not_counted": not_counted}
    for table in TABLES:
        entry, files = _write_table(table, info.get(table, {}), records, out, left)
        written += files
        index.append(entry)
    atomic_write(out / "README.md", _readme(records, Path(records_dir), out, index, set(written), left))
    written.append(out / "README.md")
    return written


def write_table(records_dir: str | Path, out_dir: str | Path, table: str) -> list[Path]:
    """One table's files into out_dir (its .md, CSV and figure; the loss-convergence curves),
    nothing else: a study that makes one table leaves the other tables and README.md as they are.
    RecordError / NoRecordsError as write_results, before anything is written."""
    records, not_counted = table_records(records_dir)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    return _write_table(table, registry.table_info().get(table, {}), records, out, {"not_counted": not_counted})[1]


def _write_table(
    table: str, meta: dict, records: dict, out: Path, left: dict[str, list[str]]
) -> tuple[tuple, list[Path]]:
    """<table>.md, its CSV and figure; returns (its README index entry, the files written)."""
    recipes = registry.by_table(table)
    df = table_frame(table, records, recipes)
    if table == "loss_convergence":  # each record's check against the 1D control, after the table's columns
        df = loss_curves.with_check(df, records)
    title = meta.get("title", table)
    csv_name = table_csv_name(table)
    with atomic_path(out / csv_name) as tmp:  # a reader (or a kill) never sees half a table
        df.to_csv(tmp, index=False)
    n_ours = int(df["ours mode"].notna().sum())
    md = [f"# {title}", "", meta.get("caption", ""), ""]
    written = [out / f"{table}.md", out / csv_name]
    fig = None
    if table == "loss_convergence":  # no paper throughput: what ran and its check, the curves below
        md += [to_markdown(df, recipes, compact=loss_curves.COMPACT), ""]
    else:
        png = figures.table_figure(title, figures.figure_rows(df, records), out / f"{table}.png")
        if png is None:
            (out / f"{table}.png").unlink(missing_ok=True)  # a figure of records no longer there
        else:
            fig = png.name
            written.append(png)
        md += [to_markdown(df, recipes, compact=True), "", *provenance_lines(df, recipes, records, fig), ""]
    md += [prose()["table_footer"].format(n_ours=n_ours, n_rows=len(df), csv=csv_name), ""]
    md += _left_out(left, recipes, records)
    if table == "loss_convergence":
        # the curves, their plot and check: from the same records
        ids = {r.id for r in recipes}
        proxy = {rid: rec for (rid, mode), rec in records.items() if mode == "proxy" and rid in ids}
        files, section = loss_curves.write_outputs(proxy, out)
        written += files
        md += [section]
    atomic_write(out / f"{table}.md", "\n".join(md))
    return (table, title, len(df), n_ours, csv_name, fig), written


def _left_out(left: dict[str, list[str]], recipes: list[Recipe], records: dict) -> list[str]:
    """The sections under a table: its rows' records skipped as bad or not counted, and those
    shown though they are not the row's run as published (--include-deviating)."""
    fnames = {r.fname for r in recipes}
    lines = []
    for key, whys in left.items():
        mine = [why for why in whys if Path(why.split(":", 1)[0]).stem in fnames]
        if mine:
            lines += [prose()[key], "", *(f"- {why}" for why in mine), ""]
    shown = [
        f"- {relative(Path(rec['_path']))}: {'; '.join(rec['_not_conforming'])}"
        for (rid, _), rec in sorted(records.items())
        if rec.get("_not_conforming") and Path(rec["_path"]).stem in fnames
    ]
    return lines + ([prose()["included_deviating"], "", *shown, ""] if shown else [])


def _readme(
    records: dict, records_dir: Path, out: Path, index: list[tuple], written: set[Path], left: dict[str, list[str]]
) -> str:
    """results/README.md: the tables' index, the other results files, how each number was made,
    and the records used."""
    text = prose()
    lines = [
        "# Results",
        "",
        text["intro"].format(records=relative(records_dir.resolve(), out.resolve())),
        "",
        "| table | rows | rows with our record | figure |",
        "|---|---|---|---|",
    ]
    lines += [
        f"| [{title}]({t}.md) ([csv]({c})) | {n} | {k} | {f'[{f}]({f})' if f else ''} |"
        for t, title, n, k, c, f in index
    ]
    others = _other_files(out, written)
    if others:
        lines += ["", "## Other results", "", "| file | what |", "|---|---|"]
        lines += [f"| [{name}]({name}) | {what} |" for name, what in others]
    lines += ["", text["how"], "## Records used", ""]
    lines.append(_records_table(records) if records else text["no_records"])
    for key, heading in (("skipped_records", "Records skipped"), ("not_counted", "Records not counted")):
        if left.get(key):
            lines += ["", f"## {heading}", "", text[key], "", *(f"- {why}" for why in left[key])]
    return "\n".join(lines) + "\n"


def _records_table(records: dict) -> str:
    rows = [
        {
            "recipe": rid,
            "mode": mode,
            "hardware": (rec.get("hardware") or {}).get("device", ""),
            "world": rec.get("world_size", ""),
            "steps": rec.get("steps", ""),
            **{k: (rec.get("versions") or {}).get(k, "") for k in ("torch", "torchao", "git")},
            "finished": rec.get("finished_at", ""),
        }
        for (rid, mode), rec in sorted(records.items())
    ]
    return pd.DataFrame(rows).astype(str).to_markdown(index=False, disable_numparse=True)


def _other_files(out: Path, written: set[Path]) -> list[tuple[str, str]]:
    found = []
    generated = {p.name for p in written} | {"README.md"}  # the tables, indexed above
    for name, what in prose()["other_files"].items():
        if (out / name).is_file():
            found.append((name, what))
    known = {n for n, _ in found} | generated
    for path in sorted(out.glob("*")):
        # hidden files (a killed writer's leftovers among them) are nobody's results
        if (
            path.is_file()
            and not path.name.startswith(".")
            and path.suffix in (".md", ".csv", ".png", ".json")
            and path.name not in known
        ):
            found.append((path.name, ""))
    return found
