"""Regenerates `results/` from the result records only.

Records live in `<records_dir>/<mode>/<id__>.json` (mode: real, proxy, dry-run), one per recipe
and mode, the latest run's. Each table gets `<table>.md` and `<table>.csv`: one line per paper
row, the paper (and bench-2412) figures from the recipe files beside ours from the records.
A cell with no record is empty. `README.md` indexes the tables, the other results files
(benchmarks, loss parity, dry-run, ...) when present, and says how each number was made.

The loss-convergence table is the exception in naming: `loss_convergence.csv` holds the curves
(step x row, recipes/loss_curves.py), so its table goes to `loss_convergence_table.csv`, and
`loss_convergence.md` carries the table, the curves' check and a link to the plot.
"""
from __future__ import annotations

import csv
import json
import math
from pathlib import Path
from typing import Any

import pandas as pd

from recipes import loss_curves, registry
from recipes.launcher import relative
from recipes.schema import TABLES, Recipe

OURS_MODES = ("real", "proxy")  # the "ours" columns take the real record if any, else the proxy's


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
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(columns), extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    tmp.replace(path)
    return path


# ----------------------------------------------------------------------------------- records
def load_records(records_dir: str | Path) -> dict[tuple[str, str], dict]:
    """{(recipe id, mode): record} from <records_dir>/<mode>/*.json."""
    out: dict[tuple[str, str], dict] = {}
    root = Path(records_dir)
    if not root.is_dir():
        return out
    for path in sorted(root.glob("*/*.json")):
        try:
            rec = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        if not isinstance(rec, dict):
            continue
        mode = rec.get("mode") or path.parent.name
        rid = rec.get("recipe") or path.stem.replace("__", "/")
        rec["_path"] = str(path)
        out[(rid, mode)] = rec
    return out


def _num(value: Any) -> float | None:
    if isinstance(value, bool) or value is None:
        return None
    try:
        v = float(value)
    except (TypeError, ValueError):
        return None
    return v if math.isfinite(v) else None


def _ours(records: dict, rid: str) -> dict | None:
    for mode in OURS_MODES:
        if (rid, mode) in records:
            return records[(rid, mode)]
    return None


def _gain(value: float | None, base: float | None) -> float | None:
    if value is None or not base:
        return None
    return 100.0 * (value / base - 1.0)


def _float8_applied(rec: dict) -> bool:
    return any(str(t).startswith("float8") for t in rec.get("toggles_applied") or [])


def _final_loss(rec: dict) -> float | None:
    losses = rec.get("losses") or []
    return _num(losses[-1]) if losses else None


def _max_loss_delta(rec: dict, base: dict) -> float | None:
    a, b = rec.get("losses") or [], base.get("losses") or []
    n = min(len(a), len(b))
    if not n or len(a) != len(b):
        return None
    return max(abs(float(x) - float(y)) for x, y in zip(a, b))


def _dry_mem(rec: dict | None) -> float | None:
    if rec is None:
        return None
    for key in ("estimated_peak_gib", "estimated_peak_memory_gib", "peak_memory_gib"):
        if _num(rec.get(key)) is not None:
            return _num(rec.get(key))
    return None


TECHNIQUE_NAMES = {"compile": "compile", "float8": "Float8", "async_tp": "AsyncTP", "fsdp": "FSDP",
                   "tp": "TP", "cp": "CP"}


def gain_of(recipe: Recipe) -> str | None:
    """What a row adds over its baseline, from the techniques lists: `compile + Float8`,
    `AsyncTP`, `Interleaved1F1B (vs 1F1B)`."""
    if not recipe.baseline:
        return None
    base = registry.get(recipe.baseline).techniques
    added = [t for t in recipe.techniques if t not in base]
    names = []
    for t in added:
        if t.startswith("pp:"):
            old = [b[3:] for b in base if b.startswith("pp:")]
            names.append(t[3:] + (f" (vs {old[0]})" if old else ""))
        else:
            names.append(TECHNIQUE_NAMES.get(t, t))
    return " + ".join(names) or None


def versions_text(rec: dict) -> str:
    v = rec.get("versions") or {}
    parts = [f"torch {v['torch']}" if v.get("torch") else "",
             f"torchao {v['torchao']}" if v.get("torchao") else "",
             f"git {v['git']}" if v.get("git") else ""]
    return ", ".join(p for p in parts if p)


def toggle_notes(rec: dict) -> str:
    """Toggles a record asked for but could not apply here, with the reason (e.g. AsyncTP on CPU),
    and Float8 run emulated: a gain measured without its technique says so beside the number."""
    notes = [f"{k} skipped: {v}" for k, v in (rec.get("toggles_skipped") or {}).items()]
    if "float8:emulated" in (rec.get("toggles_applied") or ()):
        notes.insert(0, "float8 emulated (fp32 matmul of float8-quantized operands)")
    return "; ".join(notes)


def table_csv_name(table: str) -> str:
    return "loss_convergence_table.csv" if table == "loss_convergence" else f"{table}.csv"


# ------------------------------------------------------------------------------------ tables
def table_frame(table: str, records: dict, recipes: list[Recipe] | None = None) -> pd.DataFrame:
    """The table as numbers (None where there is nothing): the CSV's content."""
    recipes = recipes if recipes is not None else registry.by_table(table)
    has_baseline = any(r.baseline for r in recipes)
    loss_table = table == "loss_convergence"
    has_bench = any("bench_tps_per_gpu" in r.reference or "bench_mem_gib" in r.reference
                    for r in recipes)
    has_pp = any(r.degrees("real")["pp"] > 1 for r in recipes)
    rows = []
    for r in recipes:
        ref, ours, dry = r.reference, _ours(records, r.id), records.get((r.id, "dry-run"))
        base_ref = None
        base_ours = None
        if r.baseline:
            base_ref = registry.get(r.baseline).reference
            base_ours = records.get((r.baseline, ours["mode"])) if ours else None
        row: dict[str, Any] = {"row": r.row, "GPUs": r.gpus}
        if not loss_table:
            row["paper TPS/GPU"] = _num(ref.get("paper_tps_per_gpu"))
            row["paper mem GiB"] = _num(ref.get("paper_mem_gib"))
            if has_bench:
                row["bench-2412 TPS/GPU"] = _num(ref.get("bench_tps_per_gpu"))
                row["bench-2412 mem GiB"] = _num(ref.get("bench_mem_gib"))
            if has_baseline:
                row["gain of"] = gain_of(r)
                row["paper gain %"] = _gain(_num(ref.get("paper_tps_per_gpu")),
                                            _num(base_ref.get("paper_tps_per_gpu")) if base_ref else None)
        tps = _num(ours.get("tokens_per_sec_per_device")) if ours else None
        mfu = _num(ours.get("mfu")) if ours and not _float8_applied(ours) else None
        row.update({
            "ours mode": ours.get("mode") if ours else None,
            "ours hardware": (ours.get("hardware") or {}).get("device") if ours else None,
            "ours versions": versions_text(ours) if ours else None,
            "ours world": ours.get("world_size") if ours else None,
            "ours TPS/device": tps,
            "ours MFU %": 100.0 * mfu if mfu is not None else None,
            "ours peak mem GiB": _num(ours.get("peak_memory_gib")) if ours else None,
            "ours final loss": _final_loss(ours) if ours else None,
        })
        if loss_table:
            row["ours steps"] = ours.get("steps") if ours else None
            row["max |Δloss| vs baseline"] = (_max_loss_delta(ours, base_ours)
                                              if ours and base_ours else None)
        elif has_baseline:
            base_tps = _num(base_ours.get("tokens_per_sec_per_device")) if base_ours else None
            row["ours gain %"] = _gain(tps, base_tps) if r.baseline else None
        if has_pp:
            bubble = _num(ours.get("pp_bubble_fraction")) if ours else None
            row["ours PP bubble %"] = 100.0 * bubble if bubble is not None else None
        row["ours notes"] = (toggle_notes(ours) or None) if ours else None
        row["dry-run est. mem GiB"] = _dry_mem(dry)
        row["recipe"] = r.id
        rows.append(row)
    df = pd.DataFrame(rows)
    for col in ("GPUs", "ours world", "ours steps"):
        if col in df:
            df[col] = df[col].astype("Int64")
    for col in [c for c in df.columns if c.endswith("gain %")]:
        df[col] = df[col].astype(float).round(2)
    return df


def _fmt_cell(col: str, value: Any, approx: bool = False) -> str:
    if value is None or value is pd.NA or (isinstance(value, float) and math.isnan(value)):
        return ""
    if col.endswith("gain %"):
        return f"{value:+.2f}%"
    if "TPS" in col:
        return f"{value:,.0f}" if value >= 100 else f"{value:,.3g}"
    if "mem GiB" in col:
        return ("~" if approx else "") + f"{value:.1f}" if value >= 1 else f"{value:.3f}"
    if col in ("ours MFU %", "ours PP bubble %"):
        return f"{value:.1f}"
    if "loss" in col:
        return f"{value:.4f}" if "Δ" not in col else f"{value:.2e}"
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def to_markdown(df: pd.DataFrame, recipes: list[Recipe]) -> str:
    approx = {r.id: bool(r.reference.get("paper_mem_approx")) for r in recipes}
    shown = df.copy().astype(object)
    for col in shown.columns:
        shown[col] = [_fmt_cell(col, v, approx.get(rid, False) and col == "paper mem GiB")
                      for v, rid in zip(df[col], df["recipe"])]
    return shown.to_markdown(index=False, disable_numparse=True)


# ---------------------------------------------------------------------------------- writing
README_HOW = """\
## How each number was produced

- **paper**, **bench-2412**: typed once into the recipe files (`[reference]` of each row) from
  `shared/reference/paper_tables.md`: the TorchTitan paper (arXiv 2410.06511) and the public
  benchmark file `llama3_h100_202412_torchtitan`. H100 GPUs; throughput read at iteration 90;
  memory = peak reserved GiB, max over ranks. `~` marks the less certain paper memory figures.
  `paper gain %` is computed from the paper's throughput column against the row's baseline;
  `gain of` names what the row adds over that baseline (compile, Float8, AsyncTP, a schedule).
- **ours**: read from the result records in `records/<mode>/<recipe>.json`, written by the
  trainer (`python -m core.train`, launched by `run-recipe run`). The real record wins over
  the proxy record when both exist; `ours mode` says which one a line shows.
  - `real`: the paper's exact configuration on GPUs.
  - `proxy`: the same layout (the same parallel dims > 1, schedule and toggles) scaled to a
    CPU: small model, short sequence, gloo. Its throughput and memory describe the proxy,
    not the paper's hardware; compare gains and loss agreement, not absolute figures.
  - `ours TPS/device`: tokens per second per rank, mean over the steps after the first
    (the first pays for lazy init and compilation).
  - `ours MFU %`: FLOPs/token x tokens/s per device / peak FLOP/s, with FLOPs/token =
    6 (N - N_emb) + 12 L H (D/H) T and the peak of the record's hardware (the vendor BF16
    peak on CUDA, the measured matmul peak on CPU). Empty when Float8 was applied (the paper
    reports no MFU with Float8).
  - `ours peak mem GiB`: max over ranks of CUDA max reserved memory (real) or the process's
    peak RSS (CPU proxy).
  - `ours hardware`, `ours versions`: the device, torch, torchao and git commit of the record.
  - `ours gain %`: our throughput against our record of the baseline row, same mode only.
    On a CPU proxy Float8 runs torchao's emulation (float8-quantized operands, fp32 matmul;
    the record's toggles say `float8:emulated`: a CPU has no fast float8 GEMM) and compile
    gains depend on tiny shapes: the sign and size describe this CPU, not an H100.
  - `ours PP bubble %`: the schedule's ideal idle fraction from its own action table
    (`pp_bubble_fraction` of the record; hardware independent).
  - `ours notes`: toggles the row asks for that could not run here, with the reason (AsyncTP
    needs CUDA symmetric memory): a gain measured without its technique says so.
  - `max |Δloss| vs baseline` (loss convergence): the largest per-step difference from the
    baseline (1D) record of the same mode and step count. The curves' check (smoothed,
    trailing window, stated tolerance) is in `loss_convergence.md`.
- **dry-run est. mem GiB**: `core.dryrun.record.dry_run` at true scale (fake process group, fake
  tensors), from `records/dry-run/`.

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
        md = [f"# {meta.get('title', table)}", "", meta.get("caption", ""), "",
              to_markdown(df, recipes), "",
              (f"{n_ours} of {len(df)} rows have a record of ours. How the numbers were made: "
              "[README.md](README.md)."), ""]
        written += [out / f"{table}.md", out / csv_name]
        if table == "loss_convergence":
            # the curves, their plot and check: from the same records
            proxy = {rid: rec for (rid, mode), rec in records.items()
                     if mode == "proxy" and rid in {r.id for r in recipes}}
            files, section = loss_curves.write_outputs(proxy, out)
            written += files
            md += [section]
        (out / f"{table}.md").write_text("\n".join(md))
        index.append((table, meta.get("title", table), len(df), n_ours, csv_name))

    lines = ["# Results", "",
             ("Generated by `run-recipe results` from the records in "
             f"`{relative(Path(records_dir).resolve(), out.resolve())}` only. Do not edit by hand."), "",
             "| table | rows | rows with our record |", "|---|---|---|"]
    lines += [f"| [{title}]({t}.md) ([csv]({c})) | {n} | {k} |" for t, title, n, k, c in index]
    others = _other_files(out, set(written))
    if others:
        lines += ["", "## Other results", "", "| file | what |", "|---|---|"]
        lines += [f"| [{name}]({name}) | {what} |" for name, what in others]
    lines += ["", README_HOW, "## Records used", ""]
    if records:
        rec_rows = []
        for (rid, mode), rec in sorted(records.items()):
            v = rec.get("versions") or {}
            rec_rows.append({"recipe": rid, "mode": mode,
                             "hardware": (rec.get("hardware") or {}).get("device", ""),
                             "world": rec.get("world_size", ""), "steps": rec.get("steps", ""),
                             "torch": v.get("torch", ""), "torchao": v.get("torchao", ""),
                             "git": v.get("git", ""),
                             "finished": rec.get("finished_at", "")})
        lines.append(pd.DataFrame(rec_rows).astype(str).to_markdown(index=False, disable_numparse=True))
    else:
        lines.append("No records yet: run `run-recipe run <id> --mode proxy` (or real, dry-run).")
    (out / "README.md").write_text("\n".join(lines) + "\n")
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

