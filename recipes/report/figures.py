"""The figure of a paper table (results/<table>.png), from the dry-run records' predictions only:
paper vs predicted TPS/GPU per row (left) and the predicted step breakdown per row, stacked
(right), so a reader sees where each technique buys its time. Written by recipes/report/results.py."""

from __future__ import annotations

import math
from pathlib import Path

import matplotlib
import pandas as pd

from core.fileio import atomic_path

matplotlib.use("Agg")  # files only, never a window
import matplotlib.pyplot as plt  # after choosing the backend

# The breakdown's parts in stacking order, with their legend labels; exposed communication comes
# per mesh dimension (`exposed_comm` of the record) between recompute and bubble.
PARTS_BEFORE = (("compute", "compute"), ("memory_bound", "memory-bound"), ("recompute", "recompute"))
PARTS_AFTER = (("bubble", "PP bubble"), ("optimizer", "optimizer"))
COMM_NAMES = {
    "dp_shard": "FSDP",
    "dp_shard_cp": "FSDP (shard x CP)",
    "dp_replicate": "HSDP replicate",
    "tp": "TP",
    "cp": "CP",
    "pp": "PP send/recv",
    "grad_norm": "grad-norm all-reduce",
}
# Parts smaller than this share of the longest step in every row are left out of the plot (a
# sliver nobody can see only crowds the legend); the caption says so.
MIN_SHARE = 0.002


def breakdown_parts(breakdown: dict) -> dict[str, float]:
    """A record's `predicted.breakdown` flattened to {legend label: seconds}, in stacking order;
    keys the model adds later are kept (after the known ones), never dropped."""
    b = dict(breakdown or {})
    comm = dict(b.pop("exposed_comm", None) or {})
    out: dict[str, float] = {}
    for key, label in PARTS_BEFORE:
        if key in b:
            out[label] = float(b.pop(key))
    for key, value in comm.items():
        out[f"exposed comm: {COMM_NAMES.get(key, key)}"] = float(value)
    after = {k: b.pop(k) for k, _ in PARTS_AFTER if k in b}
    for key, value in b.items():  # unknown parts
        if isinstance(value, int | float):
            out[key.replace("_", " ")] = float(value)
    for key, label in PARTS_AFTER:
        if key in after:
            out[label] = float(after[key])
    return out


def _colors(labels: list[str]) -> dict[str, tuple]:
    cmap = plt.get_cmap("tab20")
    fixed = ["compute", "memory-bound", "recompute", "PP bubble", "optimizer"]
    colors = {name: cmap(2 * i) for i, name in enumerate(fixed)}
    # communication in hues of its own (brown, pink, gray, olive, cyan), then their light shades
    free = [cmap(i) for i in (10, 12, 14, 16, 18, 11, 13, 15, 17, 19, 1, 3, 5, 7, 9)]
    for label in labels:
        if label not in colors:
            colors[label] = free.pop(0) if free else cmap(len(colors) % 20)
    return colors


def table_figure(title: str, rows: list[dict], path: str | Path) -> Path | None:
    """rows: per table row, in table order, {"label", "paper" (TPS/GPU or None), "predicted"
    (TPS/GPU or None), "breakdown" (the record's predicted.breakdown or None), "step_s",
    "calibration" (bool)}. Writes the PNG and returns its path; None (nothing written) when no
    row has a prediction: the figure shows predictions, never paper figures alone."""
    if not any(r.get("predicted") is not None for r in rows):
        return None
    path = Path(path)
    n = len(rows)
    parts = [breakdown_parts(r.get("breakdown")) for r in rows]
    # Seconds per step compare rows only when each row's GPU does the same work per step;
    # otherwise time per 1,000 tokens per GPU (the stack is then 1,000 / TPS exactly).
    work = [r["predicted"] * r["step_s"] for r in rows if r.get("predicted") and r.get("step_s")]
    same = bool(work) and max(work) <= 1.01 * min(work)
    scale = [
        1.0 if same or not (r.get("predicted") and r.get("step_s")) else 1000.0 / (r["predicted"] * r["step_s"])
        for r in rows
    ]
    longest = max((sum(p.values()) * s for p, s in zip(parts, scale, strict=True)), default=0.0)
    longest = longest if math.isfinite(longest) and longest > 0 else 1.0
    order: list[str] = []
    for p in parts:
        order += [k for k in p if k not in order]
    shown = [
        k for k in order if any(p.get(k, 0.0) * s >= MIN_SHARE * longest for p, s in zip(parts, scale, strict=True))
    ]

    legend_in = 0.45 + 0.2 * math.ceil(len(shown) / 4)  # the legends' band under the axes, inches
    height = 1.9 + 0.55 * n + legend_in
    fig, (ax_t, ax_b) = plt.subplots(1, 2, figsize=(14, height), sharey=True, gridspec_kw={"width_ratios": [1, 1.25]})
    y = list(range(n))
    h = 0.38
    paper = [r.get("paper") or 0.0 for r in rows]
    pred = [r.get("predicted") or 0.0 for r in rows]
    ax_t.barh([i - h / 2 for i in y], paper, h, label="paper", color="#4c72b0")
    ax_t.barh([i + h / 2 for i in y], pred, h, label="predicted", color="#dd8452")
    top = max(paper + pred) or 1.0
    for i, r in enumerate(rows):
        if r.get("predicted") is not None and r.get("paper"):
            err = 100.0 * (r["predicted"] / r["paper"] - 1.0)
            ax_t.text(r["predicted"] + 0.01 * top, i + h / 2, f"{err:+.1f}%", va="center", fontsize=8)
    ax_t.set_xlim(0, top * 1.15)
    ax_t.set_yticks(y, [r["label"] + (" †" if r.get("calibration") else "") for r in rows])
    ax_t.invert_yaxis()  # the table's order, top to bottom
    ax_t.set_xlabel("tokens / s per GPU")
    ax_t.set_title("paper vs predicted throughput (label: predicted error)", fontsize=10)

    colors = _colors(shown)
    left = [0.0] * n
    for key in shown:
        widths = [p.get(key, 0.0) * s for p, s in zip(parts, scale, strict=True)]
        ax_b.barh(y, widths, 0.6, left=left, label=key, color=colors[key])
        left = [a + b for a, b in zip(left, widths, strict=True)]
    for i, p in enumerate(parts):
        if not p:
            ax_b.text(0.0, i, "  no prediction", va="center", fontsize=8, color="gray")
    ax_b.set_xlim(0, longest * 1.05)
    ax_b.set_xlabel("predicted step time, s" if same else "predicted time per 1,000 tokens per GPU, s")
    ax_b.set_title(f"where the predicted step goes (parts under {MIN_SHARE:.1%} of the longest left out)", fontsize=10)
    note = (
        "† calibration row: a constant of the GPU spec was fitted on it"
        if any(r.get("calibration") for r in rows)
        else "no calibration row in this table: every bar is a prediction"
    )
    fig.suptitle(f"{title}\n{note}", fontsize=11)
    fig.tight_layout(rect=(0, legend_in / height, 1, 1))
    for ax, ncol in ((ax_t, 2), (ax_b, 4)):  # each legend centred under its axes, in the band
        box = ax.get_position()
        ax.legend(
            loc="upper center",
            bbox_to_anchor=(box.x0 + box.width / 2, (legend_in - 0.1) / height),
            bbox_transform=fig.transFigure,
            ncol=ncol,
            fontsize=8,
            frameon=False,
        )
    with atomic_path(path) as tmp:  # renamed, so a reader never sees half a file
        fig.savefig(tmp, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


def figure_rows(df, records: dict) -> list[dict]:
    """What table_figure draws, per row of a results table frame (recipes.report.table_data.table_frame),
    with the breakdown and step time from the row's dry-run record."""
    out = []
    for _, row in df.iterrows():
        pred = (records.get((row["recipe"], "dry-run")) or {}).get("predicted") or {}
        paper, tps = row.get("paper TPS/GPU"), row["predicted TPS/GPU"]
        out.append(
            {
                "label": row["row"],
                "paper": None if pd.isna(paper) else float(paper),
                "predicted": None if pd.isna(tps) else float(tps),
                "breakdown": pred.get("breakdown"),
                "step_s": pred.get("step_time_s"),
                "calibration": isinstance(row["calibrated on"], str),
            }
        )
    return out
