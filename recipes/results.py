"""Regenerates `results/` from the result records only.

Records live in `<records_dir>/<mode>/<id__>.json` (mode: real, proxy, dry-run), one per recipe
and mode, the latest run's. Each table gets `<table>.md` and `<table>.csv`: one line per paper
row, the paper (and bench-2412) figures from the recipe files beside the dry-run's prediction
and memory and our proxy's (or real) figures. The CSV has every column; the .md a compact table,
the provenance under it and the figure (`<table>.png`, recipes/figures.py); the numbers come from
recipes/table_data.py. A cell with no record is empty. `README.md` indexes the tables, the other
results files when present, and says how each number was made.

The loss-convergence table is the exception in naming: `loss_convergence.csv` holds the curves
(step x row, recipes/loss_curves.py), so its table goes to `loss_convergence_table.csv`, and
`loss_convergence.md` carries the table, the curves' check and a link to the plot.
"""

from __future__ import annotations

import csv
import math
from pathlib import Path
from typing import Any

import pandas as pd

from core.fileio import atomic_path, atomic_write
from recipes import figures, loss_curves, registry
from recipes.launcher import relative
from recipes.schema import TABLES, Recipe
from recipes.table_data import load_records, predicted_part, table_frame


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


def to_markdown(df: pd.DataFrame, recipes: list[Recipe], compact: bool = False) -> str:
    """Every column of the frame, or (compact) the about ten of COMPACT a person can read, the
    rest being in the CSV and the list under the table; a calibration row's prediction gets †."""
    approx = {r.id: bool(r.reference.get("paper_mem_approx")) for r in recipes}
    cols = [c for c in (COMPACT if compact else df.columns) if c in df.columns]
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
    return shown.rename(columns=COMPACT if compact else {}).to_markdown(
        index=False, disable_numparse=True, colalign=["left"] + ["right" if compact else "left"] * (len(cols) - 1)
    )


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
            "each row's dry-run record; `TPS error %` and `mem error %` are against the paper. "
            f"The model's measured error band: {_band(preds)}."
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
README_HOW = """\
## How each number was produced

- **paper**, **bench-2412**: typed once into the recipe files (`[reference]` of each row) from
  `shared/reference/paper_tables.md`: the TorchTitan paper (arXiv 2410.06511) and the public
  benchmark file `llama3_h100_202412_torchtitan`. H100 GPUs; throughput read at iteration 90;
  memory = peak reserved GiB, max over ranks; `~` marks the less certain paper memory figures.
  `paper gain %`: the paper's throughput against the row's baseline (`gain of` names what the row
  adds: compile, Float8, AsyncTP, a schedule) or, in the long-context tables, the previous row.
- **predicted** (`predicted TPS/GPU`, `TPS error %`, `predicted gain %`, `predicted MFU %`,
  `predicted step s`): the performance model (`core/dryrun/runtime.py`) at the row's true scale on
  the GPU spec `predicted GPU` (`core/dryrun/hardware/<name>.toml`: datasheet figures and cited
  benchmarks, two constants calibrated on the rows the tables name and mark †), read from the
  `predicted` part of the row's dry-run record. Gains are between predictions, errors against the
  paper. Each table's figure (`<table>.png`) sets paper and predicted TPS/GPU side by side and
  stacks the predicted step: compute, memory-bound work, recompute, communication left exposed
  per mesh dimension, pipeline bubble, optimizer.
- **dry-run mem GiB** (`dry-run est. mem GiB`, `mem error %`): `core.dryrun.record.dry_run`'s
  estimated peak reserved memory per rank at true scale, from `records/dry-run/`.
- **ours**: the result records in `records/<mode>/<recipe>.json`, written by the trainer
  (`python -m core.train`, launched by `run-recipe run`); a real record wins over a proxy one
  (`ours mode`). `real`: the paper's configuration on GPUs. `proxy`: the same layout (parallel
  dims > 1, schedule, toggles) scaled to a CPU (small model, short sequence, gloo): compare its
  gains and loss agreement, not its absolute figures.
  - `ours TPS/device`: tokens/s per rank, mean over the steps after the first (lazy init and
    compilation). `ours MFU %`: FLOPs/token (6 (N - N_emb) + 12 L H (D/H) T) x tokens/s per device
    / the peak of the record's hardware (vendor BF16 peak on CUDA, measured matmul peak on CPU);
    empty when Float8 was applied (the paper reports none). `ours peak mem GiB`: max over ranks of
    CUDA max reserved memory (real) or peak RSS (proxy). `ours hardware`, `ours versions`: the
    device, torch, torchao and git commit of the record.
  - `ours gain %`: against our record of the same comparison row, same mode only. On a CPU proxy
    Float8 runs torchao's emulation (`float8:emulated`: no fast float8 GEMM on a CPU) and compile
    gains depend on tiny shapes: the sign and size describe this CPU, not an H100.
  - `ours PP bubble %`: the schedule's ideal idle fraction from its own action table
    (`pp_bubble_fraction`; hardware independent). `ours notes`: toggles that could not run here,
    with the reason (AsyncTP needs CUDA symmetric memory): a gain measured without its technique
    says so.
  - `max |Δloss| vs baseline` (loss convergence): the largest per-step difference from the
    baseline (1D) record of the same mode and step count; the curves' check (smoothed, trailing
    window, stated tolerance) is in `loss_convergence.md`.

An empty cell means no record: nothing is typed in. Regenerate with `run-recipe results`.
"""


def write_results(records_dir: str | Path, out_dir: str | Path) -> list[Path]:
    """Write every table (.md + .csv) and README.md into out_dir. Returns the files written."""
    records = load_records(records_dir)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    info = registry.table_info()
    written: list[Path] = []
    index = []
    for table in TABLES:
        recipes = registry.by_table(table)
        df = table_frame(table, records, recipes)
        meta = info.get(table, {})
        csv_name = table_csv_name(table)
        df.to_csv(out / csv_name, index=False)
        n_ours = int(df["ours mode"].notna().sum())
        md = [f"# {meta.get('title', table)}", "", meta.get("caption", ""), ""]
        written += [out / f"{table}.md", out / csv_name]
        fig = None
        if table == "loss_convergence":  # no paper throughput: the wide table, curves below
            md += [to_markdown(df, recipes), ""]
        else:
            png = figures.table_figure(meta.get("title", table), figures.figure_rows(df, records), out / f"{table}.png")
            if png is None:
                (out / f"{table}.png").unlink(missing_ok=True)  # a figure of records no longer there
            else:
                fig = png.name
                written.append(png)
            md += [to_markdown(df, recipes, compact=True), "", *provenance_lines(df, recipes, records, fig), ""]
        md += [
            (
                f"{n_ours} of {len(df)} rows have a record of ours. Every column: [{csv_name}]({csv_name}); "
                "how the numbers were made: [README.md](README.md)."
            ),
            "",
        ]
        if table == "loss_convergence":
            # the curves, their plot and check: from the same records
            proxy = {
                rid: rec for (rid, mode), rec in records.items() if mode == "proxy" and rid in {r.id for r in recipes}
            }
            files, section = loss_curves.write_outputs(proxy, out)
            written += files
            md += [section]
        atomic_write(out / f"{table}.md", "\n".join(md))
        index.append((table, meta.get("title", table), len(df), n_ours, csv_name, fig))

    lines = [
        "# Results",
        "",
        (
            "Generated by `run-recipe results` from the records in "
            f"`{relative(Path(records_dir).resolve(), out.resolve())}` only. Do not edit by hand."
        ),
        "",
        "| table | rows | rows with our record | figure |",
        "|---|---|---|---|",
    ]
    lines += [
        f"| [{title}]({t}.md) ([csv]({c})) | {n} | {k} | {f'[{f}]({f})' if f else ''} |"
        for t, title, n, k, c, f in index
    ]
    others = _other_files(out, set(written))
    if others:
        lines += ["", "## Other results", "", "| file | what |", "|---|---|"]
        lines += [f"| [{name}]({name}) | {what} |" for name, what in others]
    lines += ["", README_HOW, "## Records used", ""]
    if records:
        rec_rows = [
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
        lines.append(pd.DataFrame(rec_rows).astype(str).to_markdown(index=False, disable_numparse=True))
    else:
        lines.append("No records yet: run `run-recipe run <id> --mode proxy` (or real, dry-run).")
    atomic_write(out / "README.md", "\n".join(lines) + "\n")
    written.append(out / "README.md")
    return written


# Results files other commands write; indexed when present (anything else found is listed too).
OTHER_FILES = {
    "loss_convergence.png": "loss curves of the four loss-convergence layouts (`run-recipe convergence`)",
    "loss_convergence.csv": "their per-step losses: step, one column per row",
    "golden/loss_convergence.json": "golden loss-convergence curves + versions (regression test prefix)",
    "dry_run.md": "true-scale dry-run memory per rank vs the paper (`run-recipe run ID --mode dry-run`)",
    "dry_run.csv": "the same as CSV",
    "loss_parity.md": "loss parity of every N-D layout vs one process (`run-recipe parity`)",
    "loss_parity.csv": "the same as CSV",
    "toggles.md": "activation checkpointing, compile, Float8, AsyncTP: effect and status",
    "benchmarks.csv": "trainer overhead, proxy MFU, FSDP memory per rank (`run-recipe bench`)",
    "checkpoint_overhead.csv": "DCP save/load times, sync vs async",
    "toggles.csv": "the same as toggles.md, one measured figure per line (`run-recipe bench`)",
    "toggles.json": "the raw measurements behind toggles.md",
    "cp_activation_memory.json": "activation memory per rank at CP 1, 2, 4 (`run-recipe cp-memory`)",
    "perf_validation.md": "the performance model vs every public throughput figure, its error band "
    "(`run-recipe dry-run-table --validate`)",
    "perf_validation.csv": "the same as CSV",
}


def _other_files(out: Path, written: set[Path]) -> list[tuple[str, str]]:
    found = []
    generated = {p.name for p in written} | {"README.md"}  # the tables, indexed above
    for name, what in OTHER_FILES.items():
        if (out / name).is_file():
            found.append((name, what))
    known = {n for n, _ in found} | generated
    for path in sorted(out.glob("*")):
        if path.is_file() and path.suffix in (".md", ".csv", ".png", ".json") and path.name not in known:
            found.append((path.name, ""))
    return found
