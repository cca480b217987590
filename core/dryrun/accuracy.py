"""The performance model's measured error band: the mean absolute error and the worst error of its
predictions over every public throughput figure it was not fitted to (results/perf_validation.md),
overall and on each GPU system that has such figures. A GPU system no judged figure ran on says
so, with what the public figures outside its spec's conditions measured (e.g. power-limited
parts), instead of borrowing another system's band.

`run-recipe dry-run-table --validate` measures it and writes core/dryrun/accuracy.toml; the
dry-run record, `run-recipe plan` and the tables print it beside each prediction.
"""

from __future__ import annotations

import functools
from pathlib import Path

import tomllib

from core.fileio import atomic_write

PATH = Path(__file__).with_name("accuracy.toml")
KEYS = ("figures", "fitted", "mean_abs_error_pct", "worst_pct", "worst_figure")
GPU_KEYS = ("figures", "mean_abs_error_pct", "worst_pct")
OUTSIDE_KEYS = ("figures", "measured_over_predicted_min", "measured_over_predicted_max", "why")


def _value(v) -> str:
    return f'"{v}"' if isinstance(v, str) else str(v)


def write(summary: dict) -> None:
    """accuracy.toml from the validation's summary (perf_validation.summary)."""
    lines = ["# Written by `run-recipe dry-run-table --validate` (recipes/report/perf_validation.py): do not edit."]
    lines += [f"{k} = {_value(summary[k])}" for k in KEYS]
    for gpu, g in sorted(summary.get("gpus", {}).items()):
        lines += ["", f"[gpus.{gpu}]"] + [f"{k} = {_value(g[k])}" for k in GPU_KEYS]
    for gpu, g in sorted(summary.get("outside", {}).items()):
        lines += ["", f"[outside.{gpu}]"] + [f"{k} = {_value(g[k])}" for k in OUTSIDE_KEYS]
    atomic_write(PATH, "\n".join(lines) + "\n")
    band.cache_clear()


@functools.cache
def band() -> dict | None:
    """The stored summary, or None before the first validation."""
    if not PATH.exists():
        return None
    return tomllib.loads(PATH.read_text(encoding="utf-8"))


def gpu_error(gpu: str, summary: dict | None = None) -> float | None:
    """The mean absolute error (a fraction) on this GPU system's figures, None if none judged it."""
    s = summary if summary is not None else band()
    g = (s or {}).get("gpus", {}).get(gpu)
    return g["mean_abs_error_pct"] / 100 if g else None


def _gpu_clause(s: dict, gpu: str) -> str:
    g = s.get("gpus", {}).get(gpu)
    if g:
        return f"; on {gpu}: ±{g['mean_abs_error_pct']:.1f}% over {g['figures']}, worst {g['worst_pct']:+.1f}%"
    out = s.get("outside", {}).get(gpu)
    clause = f"; no judged public figure ran on {gpu}"
    if out:
        lo, hi = out["measured_over_predicted_min"], out["measured_over_predicted_max"]
        clause += f", {out['figures']} outside its spec ({out['why']}) measured {lo:.2f}-{hi:.2f}x of the prediction"
    return clause


def text(summary: dict | None = None, gpu: str | None = None) -> str:
    """'±7.1% (mean absolute error over 44 public figures; worst -18.0%; on h100_sxm_80gb: ±5.0%
    over 2, worst +9.0%; results/perf_validation.md)'."""
    s = summary if summary is not None else band()
    if not s:
        return "error band not measured yet (run-recipe dry-run-table --validate)"
    return (
        f"±{s['mean_abs_error_pct']:.1f}% (mean absolute error over {s['figures']} public figures; "
        f"worst {s['worst_pct']:+.1f}%{_gpu_clause(s, gpu) if gpu else ''}; results/perf_validation.md)"
    )
