"""The loss-convergence curves from the records: per-step losses, smoothing, the check of each
N-D row against the 1D control, the plot and the check's markdown (results/loss_convergence.*).

Read by `recipes/report/results.py` (`run-recipe results`) and by `run-recipe convergence`
(recipes/studies/convergence.py, which runs the rows). From the records only, `write_outputs` makes

    results/loss_convergence.csv    step, then one loss column per row
    results/loss_convergence.png    the four curves, smoothed (EMA) and raw faint, each in its own
                                    style; below, each N-D curve minus the control's

and `check` compares each N-D curve with the 1D curve directly (never chained): the mean
|difference| of the EMA-smoothed curves over the trailing window must stay within TOLERANCE.
`with_check` adds each row's check to the loss-convergence table (COMPACT: the columns its .md shows).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import matplotlib
import pandas as pd

from core.fileio import atomic_path
from recipes import registry
from recipes.report.table_data import markdown_table
from recipes.schema import Recipe

matplotlib.use("Agg")  # files only, never a window
import matplotlib.pyplot as plt  # after choosing the backend
from matplotlib.figure import Figure

TABLE = "loss_convergence"
# Smoothing: exponential moving average over ~SMOOTH_SPAN steps (pandas ewm, span); the check
# reads the trailing TRAILING_FRACTION of the steps, past warmup and the fast initial drop.
SMOOTH_SPAN = 25
TRAILING_FRACTION = 0.2
# Stated tolerance (nats) on mean |smoothed N-D - smoothed 1D| over the trailing window. Why this
# number: results/loss_convergence.md shows the measured spread it is set against.
TOLERANCE = 0.05
# Config keys that must agree between a row and the 1D control for their curves to be comparable.
SAME_KEYS = (
    ("model", "flavor"),
    ("training", "seq_len"),
    ("training", "local_batch_size"),
    ("training", "steps"),
    ("training", "mixed_precision_param"),
    ("training", "mixed_precision_reduce"),
    ("optimizer", "lr"),
    ("lr_scheduler", "warmup_steps"),
    ("lr_scheduler", "decay_type"),
    ("job", "seed"),
    ("data", "dataset"),
    ("parallelism", "dp_shard"),
    ("parallelism", "dp_replicate"),
)


def rows() -> list[Recipe]:
    return registry.by_table(TABLE)


def column(recipe_id: str) -> str:
    """The CSV column of a row: the last part of its id (e.g. `3d_fsdp8_tp2_pp2`)."""
    return recipe_id.rsplit("/", 1)[-1]


def control() -> Recipe:
    """The 1D row every other row is compared with (the rows' common baseline)."""
    bases = {r.baseline for r in rows() if r.baseline}
    assert len(bases) == 1, f"loss-convergence rows must share one baseline, got {bases}"
    return registry.get(bases.pop())


def record_label(rec: dict, fallback: str = "?") -> str:
    """layout_label of a record, marking toggles it asked for but skipped (AsyncTP on CPU)."""
    applied = set(rec.get("toggles_applied") or ())
    skipped = {k: v for k, v in (rec.get("toggles_skipped") or {}).items() if k not in applied}
    return layout_label(rec.get("config"), fallback, skipped)


def layout_label(cfg: dict | None, fallback: str = "?", skipped: dict | None = None) -> str:
    """The layout a record ran, from its resolved config: `3D FSDP 2 x TP 2 x PP 2 (...)`."""
    if not cfg or "parallelism" not in cfg:
        return fallback
    skipped = skipped or {}
    p = cfg["parallelism"]
    dims = [
        (name, p[key])
        for name, key in (("HSDP", "dp_replicate"), ("FSDP", "dp_shard"), ("TP", "tp"), ("PP", "pp"), ("CP", "cp"))
        if p[key] > 1
    ]
    extras = []
    if p["pp"] > 1:
        extras.append(p["pp_schedule"])
    if cfg["compile"]["enabled"]:
        extras.append("compile" + (" skipped" if "compile" in skipped else ""))
    if cfg["float8"]["enabled"]:
        extras.append("Float8" + (" skipped" if "float8" in skipped else ""))
    if p.get("enable_async_tp") and p["tp"] > 1:
        extras.append("AsyncTP" + (" skipped" if "async_tp" in skipped else ""))
    text = f"{len(dims)}D " + " x ".join(f"{n} {d}" for n, d in dims)
    return text + (f" ({', '.join(extras)})" if extras else "")


# ----------------------------------------------------------------------------------- analysis
def curves(records: dict[str, dict]) -> pd.DataFrame:
    """{recipe id: record} -> DataFrame indexed by step (1..), one loss column per row, in
    table order; rows without a record are absent, shorter runs are NaN-padded."""
    cols = {}
    for r in rows():
        rec = records.get(r.id)
        if rec and rec.get("losses"):
            first, losses = loss_steps(rec)
            cols[column(r.id)] = pd.Series(
                [float(x) for x in losses], index=range(first, first + len(losses)), dtype=float
            )
    df = pd.DataFrame(cols)
    df.index.name = "step"
    return df


def loss_steps(rec: dict) -> tuple[int, list[float]]:
    """(first step, losses from it) of a record: a resumed run's whole history when its
    checkpoint kept it (record["history"]), else the steps of its last launch."""
    history = rec.get("history") or {}
    if history.get("losses") and int(history.get("from_step", 0)) <= int(rec.get("start_step") or 0) + 1:
        return int(history["from_step"]), history["losses"]
    return int(rec.get("start_step") or 0) + 1, rec["losses"]


def smooth(df: pd.DataFrame, span: int = SMOOTH_SPAN) -> pd.DataFrame:
    return df.ewm(span=span, adjust=True).mean()


def comparable(rec: dict, base: dict) -> list[str]:
    """Why a record's curve cannot be compared with the control's (empty: it can)."""
    why = []
    for section, key in SAME_KEYS:
        a = (rec.get("config") or {}).get(section, {}).get(key)
        b = (base.get("config") or {}).get(section, {}).get(key)
        if a != b:
            why.append(f"{section}.{key} {a!r} != control's {b!r}")
    if any(loss_steps(r)[0] > 1 for r in (rec, base) if r.get("losses")):
        why.append("resumed from a checkpoint without the earlier steps' losses")
    for r in (rec, base):
        diff = (r.get("resumed") or {}).get("replayed_steps_max_abs_diff", 0.0)
        if diff > 1e-6:
            why.append(f"{r.get('recipe')}: resumed inexactly (replayed steps differ by {diff:.2e})")
    return why


def check(records: dict[str, dict], tolerance: float = TOLERANCE) -> list[dict]:
    """Each N-D row against the 1D control: trailing-window mean |Δ| of the smoothed curves
    (the checked figure), plus the raw per-step spread for context. One dict per N-D row."""
    base_id = control().id
    base = records.get(base_id)
    df = curves(records)
    sm = smooth(df)
    out = []
    for r in rows():
        if r.id == base_id:
            continue
        rec = records.get(r.id)
        res: dict[str, Any] = {
            "recipe": r.id,
            "column": column(r.id),
            "tolerance": tolerance,
            "layout": record_label(rec, column(r.id)) if rec else None,
        }
        if rec is None or base is None:
            res.update(status="no record" if rec is None else "no control record", passed=None)
            out.append(res)
            continue
        why = comparable(rec, base)
        if why:
            res.update(status="not comparable: " + "; ".join(why), passed=False)
            out.append(res)
            continue
        steps = len(df)
        window = max(1, round(steps * TRAILING_FRACTION))
        a, b = sm[res["column"]], sm[column(base_id)]
        raw = (df[res["column"]] - df[column(base_id)]).abs()
        trail = (a - b).abs().iloc[-window:]
        res.update(
            steps=steps,
            window=window,
            mean_abs_diff_smoothed=float(trail.mean()),
            max_abs_diff_smoothed=float(trail.max()),
            mean_abs_diff_raw_trailing=float(raw.iloc[-window:].mean()),
            max_abs_diff_raw=float(raw.max()),
            first_step_diff=float(raw.iloc[0]),
            final_loss=float(a.iloc[-1]),
            control_final_loss=float(b.iloc[-1]),
        )
        res["passed"] = res["mean_abs_diff_smoothed"] <= tolerance
        res["status"] = "pass" if res["passed"] else "FAIL"
        out.append(res)
    return out


# The check's columns of loss_convergence_table.csv (after the table's own), and the few columns
# of that table results/loss_convergence.md shows (frame column -> header); the rest stay in the CSV.
LAYOUT, CHECK_FIGURE, VERDICT = "ours layout", "check mean |Δloss| vs 1D", "check"
COMPACT = {
    "row": "row",
    LAYOUT: "layout run",
    "ours mode": "mode",
    "ours steps": "steps",
    "ours final loss": "final loss",
    CHECK_FIGURE: "mean |Δ| vs 1D, smoothed",
    VERDICT: f"check (tolerance {TOLERANCE:g})",
}


def with_check(frame: pd.DataFrame, records: dict[tuple[str, str], dict]) -> pd.DataFrame:
    """The table's frame with the layout each row's record ran and that record's check against
    the 1D control of the same mode (`check`): its checked figure and its verdict."""
    results: dict[tuple[str, str], dict] = {}
    for mode in frame["ours mode"].dropna().unique():
        of_mode = {rid: rec for (rid, m), rec in records.items() if m == mode}
        results.update({(res["recipe"], mode): res for res in check(of_mode)})
    layouts, figures, verdicts = [], [], []
    for rid, mode in zip(frame["recipe"], frame["ours mode"], strict=True):
        rec = records.get((rid, mode)) if isinstance(mode, str) else None
        res = results.get((rid, mode), {})
        layouts.append(record_label(rec, column(rid)) if rec else None)
        figures.append(res.get("mean_abs_diff_smoothed"))
        verdicts.append(None if rec is None else "control" if rid == control().id else res.get("status"))
    return frame.assign(**{LAYOUT: layouts, CHECK_FIGURE: figures, VERDICT: verdicts})


def spread(records: dict[str, dict]) -> dict[str, float]:
    """The control's own noise in the trailing window: std of raw - smoothed (batch-to-batch
    noise every layout shares), and how far the smoothed curve still falls across the window."""
    df = curves(records)
    name = column(control().id)
    if name not in df:
        return {}
    window = max(1, round(len(df) * TRAILING_FRACTION))
    raw, sm = df[name].iloc[-window:], smooth(df)[name].iloc[-window:]
    return {
        "window": window,
        "noise_std": float((raw - sm).std()) if window > 1 else float("nan"),
        "smoothed_drop": float(sm.iloc[0] - sm.iloc[-1]),
    }


# ------------------------------------------------------------------------------------ outputs
# Each run's own line style and marker: where the curves overlap, as they should, every run still shows.
STYLES = (("-", None), ("--", "o"), ("-.", "s"), (":", "^"))


def _label(rec: dict, name: str, res: dict | None) -> str:
    label = record_label(rec, name)
    if res is None:
        return label + "  — control"
    if res.get("mean_abs_diff_smoothed") is not None:
        sign = "≤" if res["passed"] else ">"
        return label + f"  — |Δ| {res['mean_abs_diff_smoothed']:.4f} {sign} {res['tolerance']:g}"
    return label + f"  — {res['status']}"


def figure(records: dict[str, dict], results: list[dict]) -> Figure:
    """Two panels sharing the step axis: every run's loss (smoothed, raw faint), and each N-D run's
    smoothed loss minus the control's (the checked difference, its trailing window shaded). Both
    axes span every point drawn on them."""
    df, sm = curves(records), smooth(curves(records))
    by_col = {res["column"]: res for res in results}
    base = column(control().id)
    fig, (ax, diff) = plt.subplots(2, 1, sharex=True, figsize=(9, 8), dpi=120, height_ratios=(3, 2))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    every = max(1, len(df) // 12)
    for i, r in enumerate(rows()):
        name = column(r.id)
        if name not in df:
            continue
        style, marker = STYLES[i % len(STYLES)]
        line = {"color": colors[i % len(colors)], "linestyle": style, "marker": marker, "markersize": 4}
        line["markevery"] = (i * every // len(STYLES), every)  # staggered: overlapping markers stay apart
        ax.plot(df.index, df[name], color=line["color"], alpha=0.18, linewidth=0.7)
        width = 3.0 if name == base else 1.3  # the control widest: the runs drawn over it leave its edges
        ax.plot(sm.index, sm[name], linewidth=width, label=_label(records[r.id], name, by_col.get(name)), **line)
        if name != base and base in sm:
            diff.plot(sm.index, sm[name] - sm[base], linewidth=1.2, label=record_label(records[r.id], name), **line)
    _difference_axis(diff, len(df))
    cfg = (records.get(control().id) or next(iter(records.values()), {})).get("config", {})
    t = cfg.get("training", {})
    ax.set_title(
        "Loss convergence (CPU proxy): each layout vs 1D FSDP\n"
        f"{cfg.get('model', {}).get('flavor', '?')}, seq {t.get('seq_len', '?')}, "
        f"global batch {t.get('local_batch_size', 0) * cfg.get('parallelism', {}).get('dp_shard', 0)}, "
        f"{t.get('mixed_precision_param', '?')} params + {t.get('mixed_precision_reduce', '?')} reduce; "
        f"EMA span {SMOOTH_SPAN}, tolerance on the last {int(TRAILING_FRACTION * 100)}% of steps",
        fontsize=9,
    )
    ax.set_ylabel("training loss (nats)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7.5, loc="upper right")
    fig.tight_layout()
    return fig


def _difference_axis(diff, steps: int) -> None:
    """The difference panel's zero line, the check's trailing window, its tolerance when it fits
    the scale of the differences (else named in the label), and its labels; its runs are told
    apart by the loss panel's legend (the same colours, styles and markers)."""
    diff.axhline(0.0, color="0.4", linewidth=0.8)
    low, high = diff.get_ylim()
    if steps:
        window = max(1, round(steps * TRAILING_FRACTION))
        diff.axvspan(steps - window + 0.5, steps + 0.5, color="0.85", alpha=0.5, linewidth=0)
        diff.text(steps + 0.5 - window / 2, high, "checked window", ha="center", va="top", fontsize=7)
    if low <= -TOLERANCE and high >= TOLERANCE:
        for y in (-TOLERANCE, TOLERANCE):
            diff.axhline(y, color="0.3", linestyle=":", linewidth=0.8)
        what = f"dotted: ±{TOLERANCE:g} tolerance"
    else:
        what = f"tolerance ±{TOLERANCE:g}: beyond this scale"
    diff.set_ylabel(f"smoothed loss − 1D (nats)\n{what}", fontsize=8)
    diff.set_xlabel("step")
    diff.grid(alpha=0.3)


def plot(records: dict[str, dict], results: list[dict], path: Path) -> Path:
    fig = figure(records, results)
    with atomic_path(path) as tmp:  # renamed, so a reader never sees half a file
        fig.savefig(tmp)
    plt.close(fig)
    return path


class _Cfg:
    """Sections of a record's config; missing keys read as '?' (records of older builds)."""

    def __init__(self, cfg: dict):
        self.cfg = cfg

    def __getattr__(self, section):
        class _S(dict):
            def __missing__(self, key):
                return "?"

        return _S(self.cfg.get(section) or {})


def _fmt(v, spec=".4f") -> str:
    return "" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)


def markdown(records: dict[str, dict], results: list[dict], walls: dict[str, float] | None = None) -> str:
    """The check as a markdown section (for results/loss_convergence.md)."""
    base = records.get(control().id)
    lines = ["## Convergence check (CPU proxies)", ""]
    if base is None:
        return "\n".join(lines + ["No record of the 1D control yet: run `run-recipe convergence`.", ""])
    sp = spread(records)
    cfg = _Cfg(base.get("config") or {})
    t = cfg.training
    v = base.get("versions") or {}
    lines += [
        (
            f"Each N-D curve is compared with the 1D control (`{control().id}`) directly. Checked "
            f"figure: mean |smoothed N-D − smoothed 1D| over the last {int(TRAILING_FRACTION * 100)}% of "
            f"the steps (EMA span {SMOOTH_SPAN}); **tolerance {TOLERANCE:g} nats**."
        ),
        "",
        (
            f"Runs: {cfg.model['flavor']}, seq {t['seq_len']}, FSDP "
            f"{cfg.parallelism['dp_shard']} x local batch {t['local_batch_size']} in every "
            f"layout (the same global batch and token order), {t['mixed_precision_param']} params + "
            f"{t['mixed_precision_reduce']} reduce, {len(base['losses'])} steps, warmup "
            f"{cfg.lr_scheduler['warmup_steps']}, lr {cfg.optimizer['lr']}. "
            f"Hardware: {(base.get('hardware') or {}).get('device', '?')}; torch {v.get('torch', '?')}, "
            f"torchao {v.get('torchao', '?')}, git {v.get('git', '?') or '?'}."
        ),
        "",
    ]
    if sp:
        lines += [
            (
                f"Why {TOLERANCE:g}: over the same window the control's raw loss scatters around its "
                f"smoothed curve with std {sp['noise_std']:.3f} nats (batch-to-batch noise), and "
                f"the smoothed curve still falls {sp['smoothed_drop']:.3f} nats. Bf16 rounding and "
                "Float8 (e4m3, 3 mantissa bits) make the N-D trajectories drift apart step by step "
                "(see the raw columns); a layout bug (a wrong gradient reduction, a missing "
                "microbatch, an unmasked CP shard) shows as a persistent offset of that order or "
                "larger, which the smoothed comparison exposes."
            ),
            "",
        ]
    lines += _check_table(records, results, walls or {})
    passed = [r for r in results if r.get("passed")]
    lines += [
        "",
        (
            f"**{len(passed)} of {len(results)} N-D layouts within tolerance.** "
            "Curves: [loss_convergence.png](loss_convergence.png), per-step losses: "
            "[loss_convergence.csv](loss_convergence.csv), golden: "
            "[golden/loss_convergence.json](golden/loss_convergence.json)."
        ),
        "",
    ]
    return "\n".join(lines)


def _check_table(records: dict[str, dict], results: list[dict], walls: dict[str, float]) -> list[str]:
    """The check's figures per layout as a markdown table, then the toggles skipped and where."""
    base = records[control().id]
    table = [{"layout (proxy)": record_label(base, column(control().id)), "recipe": control().id, "status": "control"}]
    for res in results:
        row = {
            "layout (proxy)": res.get("layout") or res["column"],
            "recipe": res["recipe"],
            "status": res["status"],
            "mean |Δ| smoothed, trailing": _fmt(res.get("mean_abs_diff_smoothed")),
            "max |Δ| smoothed, trailing": _fmt(res.get("max_abs_diff_smoothed")),
            "mean |Δ| raw, trailing": _fmt(res.get("mean_abs_diff_raw_trailing")),
            "max |Δ| raw, any step": _fmt(res.get("max_abs_diff_raw")),
            "|Δ| at step 1": _fmt(res.get("first_step_diff"), ".2e"),
            "final smoothed loss (control)": (
                f"{_fmt(res.get('final_loss'))} ({_fmt(res.get('control_final_loss'))})"
                if res.get("final_loss") is not None
                else ""
            ),
        }
        table.append(row)
    skipped: dict[str, list[str]] = {}  # why a toggle did not run -> the rows it did not run in
    for row in table:
        rec = records.get(row["recipe"]) or {}
        for toggle, why in (rec.get("toggles_skipped") or {}).items():
            skipped.setdefault(f"{toggle}: {why}", []).append(column(row["recipe"]))
        row["train loop s"] = _fmt(walls.get(row["recipe"]), ".0f")
    lines = [markdown_table(pd.DataFrame(table).fillna(""))]
    if skipped:
        lines += ["", "Toggles asked for but skipped here:", ""]
        lines += [f"- {why} ({', '.join(names)})" for why, names in skipped.items()]
    return lines


def write_outputs(records: dict[str, dict], out_dir: Path) -> tuple[list[Path], str]:
    """From {recipe id: record}: loss_convergence.csv + .png in out_dir; returns (files, the
    check's markdown section). Nothing is written without a record."""
    out_dir = Path(out_dir)
    df = curves(records)
    if df.empty:
        return [], markdown(records, [])
    out_dir.mkdir(parents=True, exist_ok=True)
    results = check(records)
    csv = out_dir / "loss_convergence.csv"
    with atomic_path(csv) as tmp:
        df.reset_index().to_csv(tmp, index=False, float_format="%.6f")
    png = plot(records, results, out_dir / "loss_convergence.png")
    walls = {rid: rec["wall_s"] for rid, rec in records.items() if rec.get("wall_s") is not None}
    return [csv, png], markdown(records, results, walls)
