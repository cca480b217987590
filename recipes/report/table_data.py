"""The numbers of a results table, from the result records only: one line per paper row, the
paper figures beside the dry-run's prediction and memory and our record's (the CSV's content)."""

from __future__ import annotations

import itertools
import json
import math
import re
from pathlib import Path
from typing import Any

import pandas as pd

from recipes import registry
from recipes.schema import Recipe

OURS_MODES = ("real", "proxy")  # the "ours" columns take the real record if any, else the proxy's


# ----------------------------------------------------------------------------------- records
# The fields the tables read, each with the types a record may give it (absent is fine: a mode
# records what it measures). A number is int or float; None is an empty cell.
NUMBER = (int, float)
RECORD_FIELDS: dict[str, tuple[type, ...]] = {
    "recipe": (str,),
    "mode": (str,),
    "tokens_per_sec_per_device": (*NUMBER, type(None)),
    "mfu": (*NUMBER, type(None)),
    "peak_memory_gib": (*NUMBER, type(None)),
    "estimated_peak_gib": (*NUMBER, type(None)),
    "estimated_peak_memory_gib": (*NUMBER, type(None)),
    "pp_bubble_fraction": (*NUMBER, type(None)),
    "wall_s": (*NUMBER, type(None)),
    "steps": (int,),
    "losses": (list,),
    "toggles_applied": (list,),
    "toggles_skipped": (dict,),
    "hardware": (dict,),
    "versions": (dict,),
    "predicted": (dict,),
    "timings_s": (dict,),
    "finished_at": (str,),
}


# The fields today's records of each mode hold and the tables read: a record without one is of
# another schema version, whose cells would go blank (a tuple: any one of these names).
REQUIRED_FIELDS: dict[str, tuple[str | tuple[str, ...], ...]] = {
    "proxy": (
        "recipe",
        "mode",
        "world_size",
        "steps",
        "losses",
        "tokens_per_sec_per_device",
        "mfu",
        "peak_memory_gib",
        "toggles_applied",
        "hardware",
    ),
    "dry-run": ("recipe", "mode", ("estimated_peak_gib", "estimated_peak_memory_gib", "peak_memory_gib")),
}
REQUIRED_FIELDS["real"] = REQUIRED_FIELDS["proxy"]


class RecordError(ValueError):
    """A record the tables cannot use: the message names the file and the field."""


class NoRecordsError(ValueError):
    """A records folder that is missing or holds no record: tables made from it would be blank."""


def missing_fields(rec: dict, mode: str) -> list[str]:
    """The fields of REQUIRED_FIELDS[mode] the record lacks (`a or b` where any one would do)."""
    out = []
    for need in REQUIRED_FIELDS[mode]:
        names = need if isinstance(need, tuple) else (need,)
        if not any(n in rec for n in names):
            out.append(" or ".join(names))
    return out


def check_record(path: Path, filed: bool = True) -> dict:
    """The record at `path`, parsed and its fields' types checked (RecordError otherwise).
    filed: it is filed as <mode>/<id__>.json (else a run folder's result.json)."""
    try:
        rec = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError) as e:
        raise RecordError(f"{path}: cannot be read ({e})") from None
    except json.JSONDecodeError as e:
        raise RecordError(f"{path}: not valid JSON (line {e.lineno}, column {e.colno}: {e.msg})") from None
    if not isinstance(rec, dict):
        raise RecordError(f"{path}: a record is a JSON object, this is a {type(rec).__name__}")
    for field, types in RECORD_FIELDS.items():
        value = rec.get(field)
        if field in rec and (not isinstance(value, types) or (isinstance(value, bool) and bool not in types)):
            want = " or ".join(
                sorted({"number" if t in NUMBER else "null" if t is type(None) else t.__name__ for t in types})
            )
            raise RecordError(f"{path}: field {field!r} is {type(value).__name__} {value!r:.40}, expected {want}")
    if any(not isinstance(x, NUMBER) or isinstance(x, bool) for x in rec.get("losses") or []):
        raise RecordError(f"{path}: field 'losses' holds a value that is not a number")
    mode = path.parent.name  # records are filed as <mode>/<id__>.json ...
    if mode not in REQUIRED_FIELDS and not filed:  # ... a run folder's result.json says its own
        mode = rec.get("mode") if rec.get("mode") in REQUIRED_FIELDS else mode
    if mode not in REQUIRED_FIELDS:
        raise RecordError(f"{path}: in a folder named {mode!r}, not a mode ({', '.join(REQUIRED_FIELDS)})")
    if "mode" in rec and rec["mode"] != mode:
        raise RecordError(f"{path}: a record of mode {rec['mode']!r} filed under {mode}/")
    missing = missing_fields(rec, mode)
    if missing:
        raise RecordError(
            f"{path}: a record of another schema version: no {', '.join(repr(m) for m in missing)} "
            f"(run the row again to record it)"
        )
    return rec


def load_records(records_dir: str | Path, skipped: list[str] | None = None) -> dict[tuple[str, str], dict]:
    """{(recipe id, mode): record} from <records_dir>/<mode>/*.json. A bad record raises
    RecordError; given a `skipped` list, it is left out and its reason appended there instead.
    NoRecordsError when the folder is missing or holds no record file."""
    out: dict[tuple[str, str], dict] = {}
    root = Path(records_dir)
    if not root.is_dir():
        raise NoRecordsError(f"{root}: {'not a folder' if root.exists() else 'no such folder'}")
    files = sorted(root.glob("*/*.json"))
    if not files:
        raise NoRecordsError(f"{root}: no record in it (<mode>/<id__>.json)")
    for path in files:
        try:
            rec = check_record(path)
        except RecordError as e:
            if skipped is None:
                raise
            skipped.append(str(e))
            continue
        rec["_path"] = str(path)
        out[(rec["recipe"], rec["mode"])] = rec
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
    return next((records[(rid, mode)] for mode in OURS_MODES if (rid, mode) in records), None)


def _gain(value: float | None, base: float | None) -> float | None:
    """value over base in % (also each error vs the paper); None without both."""
    return None if value is None or not base else 100.0 * (value / base - 1.0)


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
    return max(abs(float(x) - float(y)) for x, y in zip(a, b, strict=False))


def _dry_mem(rec: dict | None) -> float | None:
    keys = ("estimated_peak_gib", "estimated_peak_memory_gib", "peak_memory_gib")
    return next((_num(rec[k]) for k in keys if _num(rec.get(k)) is not None), None) if rec else None


TECHNIQUE_NAMES = {
    "compile": "compile",
    "float8": "Float8",
    "async_tp": "AsyncTP",
    "fsdp": "FSDP",
    "tp": "TP",
    "cp": "CP",
}
DIM_NAMES = {"cp": "CP", "dp_shard": "FSDP", "dp_replicate": "HSDP", "tp": "TP", "pp": "PP"}


def comparisons(recipes: list[Recipe]) -> dict[str, str]:
    """{row id: the id its gains are over}: the row's baseline; in a table without baselines (the
    long-context tables) the previous row, so each CP doubling shows its throughput ratio."""
    if any(r.baseline for r in recipes):
        return {r.id: r.baseline for r in recipes if r.baseline}
    return {b.id: a.id for a, b in itertools.pairwise(recipes)}


def gain_of(recipe: Recipe, base_id: str | None = None) -> str | None:
    """What a row adds over its baseline, from the techniques lists: `compile + Float8`,
    `AsyncTP`, `Interleaved1F1B (vs 1F1B)`; over a previous row (base_id), the parallel degrees
    that change: `CP 2, FSDP 4 (vs CP 1, FSDP 8)`."""
    if not recipe.baseline:
        if not base_id:
            return None
        new, old = recipe.degrees("real"), registry.get(base_id).degrees("real")
        dims = [d for d in DIM_NAMES if new.get(d) != old.get(d)]
        return (
            (
                ", ".join(f"{DIM_NAMES[d]} {new[d]}" for d in dims)
                + " (vs "
                + ", ".join(f"{DIM_NAMES[d]} {old[d]}" for d in dims)
                + ")"
            )
            if dims
            else None
        )
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


def predicted_part(rec: dict | None) -> dict:
    """The performance model's part of a dry-run record ({} when it has none)."""
    p = (rec or {}).get("predicted")
    return p if isinstance(p, dict) else {}


def calibrated_constants(note: str | None, rid: str) -> list[str]:
    """The constants a record's calibration note (`<constant> on <recipe id>, ...`) says were
    fitted on the row rid."""
    return [const for const, row in re.findall(r"([\w.]+) on ([\w./-]+)", note or "") if row == rid]


def versions_text(rec: dict) -> str:
    v = rec.get("versions") or {}
    parts = [
        f"torch {v['torch']}" if v.get("torch") else "",
        f"torchao {v['torchao']}" if v.get("torchao") else "",
        f"git {v['git']}" if v.get("git") else "",
    ]
    return ", ".join(p for p in parts if p)


def toggle_notes(rec: dict) -> str:
    """Toggles a record asked for but could not apply here, with the reason (e.g. AsyncTP on CPU),
    and Float8 run emulated: a gain measured without its technique says so beside the number."""
    notes = [f"{k} skipped: {v}" for k, v in (rec.get("toggles_skipped") or {}).items()]
    if "float8:emulated" in (rec.get("toggles_applied") or ()):
        notes.insert(0, "float8 emulated (fp32 matmul of float8-quantized operands)")
    return "; ".join(notes)


def deviation_note(ours: dict | None, dry: dict | None) -> str:
    """Why the row's records are not its run as published (compliance.counted marks them), or ""."""
    notes = [
        f"{what} record not conforming: {'; '.join(rec['_not_conforming'])}"
        for what, rec in (("our", ours), ("dry-run", dry))
        if rec and rec.get("_not_conforming")
    ]
    return "; ".join(notes)


# ------------------------------------------------------------------------------------ tables
def markdown_table(frame: pd.DataFrame, **options: Any) -> str:
    """A frame of strings as a GitHub table (`to_markdown`, numbers kept as written), every `|` of
    a header or cell escaped: unescaped, it ends the cell (`mean |Δ|` split one header in three
    and the page showed no table)."""
    escaped = frame.astype(str).apply(lambda col: col.str.replace("|", "\\|", regex=False))
    escaped.columns = [str(c).replace("|", "\\|") for c in frame.columns]
    return escaped.to_markdown(index=False, disable_numparse=True, **options)


def _predicted_columns(r: Recipe, dry: dict | None, base: tuple[bool, str | None], records: dict, loss: bool) -> dict:
    """A row's columns from the performance model's part of its dry-run record; base: (whether the
    table has baselines, the id this row's gain is over)."""
    ref, pred, row = r.reference, predicted_part(dry), {}
    tps_pred = _num(pred.get("tokens_per_sec_per_gpu"))
    row["predicted TPS/GPU"] = tps_pred
    if not loss:
        row["predicted TPS error %"] = _gain(tps_pred, _num(ref.get("paper_tps_per_gpu")))
        has_baseline, base_id = base
        if has_baseline:
            base_pred = _num(predicted_part(records.get((base_id, "dry-run"))).get("tokens_per_sec_per_gpu"))
            row["predicted gain %"] = _gain(tps_pred, base_pred) if base_id else None
        row["dry-run mem error %"] = _gain(_dry_mem(dry), _num(ref.get("paper_mem_gib")))
    mfu_pred = _num(pred.get("mfu"))
    row["predicted MFU %"] = round(100.0 * mfu_pred, 2) if mfu_pred is not None else None
    row["predicted step s"] = _num(pred.get("step_time_s"))
    row["predicted GPU"] = pred.get("gpu")
    row["predicted fits GPU"] = pred.get("fits")
    row["calibrated on"] = ", ".join(calibrated_constants(pred.get("calibration"), r.id)) or None
    return row


def table_frame(table: str, records: dict, recipes: list[Recipe] | None = None) -> pd.DataFrame:
    """The table as numbers (None where there is nothing): the CSV's content."""
    recipes = recipes if recipes is not None else registry.by_table(table)
    loss_table = table == "loss_convergence"
    bases = comparisons(recipes)
    has_baseline = bool(bases)
    has_bench = any("bench_tps_per_gpu" in r.reference or "bench_mem_gib" in r.reference for r in recipes)
    has_pp = any(r.degrees("real")["pp"] > 1 for r in recipes)
    rows = []
    for r in recipes:
        ref, ours, dry = r.reference, _ours(records, r.id), records.get((r.id, "dry-run"))
        base_id = bases.get(r.id)
        base_ref = base_ours = None
        if base_id:
            base_ref = registry.get(base_id).reference
            base_ours = records.get((base_id, ours["mode"])) if ours else None
        row: dict[str, Any] = {"row": r.row, "GPUs": r.gpus}
        if not loss_table:
            row["paper TPS/GPU"] = _num(ref.get("paper_tps_per_gpu"))
            row["paper mem GiB"] = _num(ref.get("paper_mem_gib"))
            if has_bench:
                row["bench-2412 TPS/GPU"] = _num(ref.get("bench_tps_per_gpu"))
                row["bench-2412 mem GiB"] = _num(ref.get("bench_mem_gib"))
            if has_baseline:
                row["gain of"] = gain_of(r, base_id)
                row["paper gain %"] = _gain(
                    _num(ref.get("paper_tps_per_gpu")), _num(base_ref.get("paper_tps_per_gpu")) if base_ref else None
                )
        tps = _num(ours.get("tokens_per_sec_per_device")) if ours else None
        mfu = _num(ours.get("mfu")) if ours and not _float8_applied(ours) else None
        row.update(
            {
                "ours mode": ours.get("mode") if ours else None,
                "ours hardware": (ours.get("hardware") or {}).get("device") if ours else None,
                "ours versions": versions_text(ours) if ours else None,
                "ours world": ours.get("world_size") if ours else None,
                "ours TPS/device": tps,
                "ours MFU %": 100.0 * mfu if mfu is not None else None,
                "ours peak mem GiB": _num(ours.get("peak_memory_gib")) if ours else None,
                "ours final loss": _final_loss(ours) if ours else None,
            }
        )
        if loss_table:
            row["ours steps"] = ours.get("steps") if ours else None
            row["max |Δloss| vs baseline"] = _max_loss_delta(ours, base_ours) if ours and base_ours else None
        elif has_baseline:
            base_tps = _num(base_ours.get("tokens_per_sec_per_device")) if base_ours else None
            row["ours gain %"] = _gain(tps, base_tps) if base_id else None
        if has_pp:
            bubble = _num(ours.get("pp_bubble_fraction")) if ours else None
            row["ours PP bubble %"] = 100.0 * bubble if bubble is not None else None
        row["ours notes"] = (
            "; ".join(n for n in (deviation_note(ours, dry), toggle_notes(ours) if ours else "") if n) or None
        )
        if deviation_note(ours, dry):  # shown only with `results --include-deviating`: marked
            row["row"] = f"{r.row} ≠"
        row["dry-run est. mem GiB"] = _dry_mem(dry)
        row["recipe"] = r.id
        # the performance model's columns: after today's, so every reader of those keeps working
        row.update(_predicted_columns(r, dry, (has_baseline, base_id), records, loss_table))
        rows.append(row)
    df = pd.DataFrame(rows)
    if "predicted fits GPU" in df:
        df["predicted fits GPU"] = df["predicted fits GPU"].astype("boolean")
    for col in ("GPUs", "ours world", "ours steps"):
        if col in df:
            df[col] = df[col].astype("Int64")
    for col in [c for c in df.columns if c.endswith(("gain %", "error %"))]:  # errors as shown: no double rounding
        df[col] = df[col].astype(float).round(2 if col.endswith("gain %") else 1)
    return df
