"""The performance model's measured error band: the mean absolute error and the worst error of its
predictions over every public throughput figure it was not fitted to (results/perf_validation.md).

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


def write(summary: dict) -> None:
    """accuracy.toml from the validation's summary (perf_validation.summary)."""
    lines = ["# Written by `run-recipe dry-run-table --validate` (recipes/perf_validation.py): do not edit."]
    for k in KEYS:
        v = summary[k]
        lines.append(f'{k} = "{v}"' if isinstance(v, str) else f"{k} = {v}")
    atomic_write(PATH, "\n".join(lines) + "\n")
    band.cache_clear()


@functools.cache
def band() -> dict | None:
    """The stored summary, or None before the first validation."""
    if not PATH.exists():
        return None
    return tomllib.loads(PATH.read_text(encoding="utf-8"))


def text(summary: dict | None = None) -> str:
    """'±7.1% (mean absolute error over 44 public figures; worst -18.0%)'."""
    s = summary if summary is not None else band()
    if not s:
        return "error band not measured yet (run-recipe dry-run-table --validate)"
    return (
        f"±{s['mean_abs_error_pct']:.1f}% (mean absolute error over {s['figures']} public figures; "
        f"worst {s['worst_pct']:+.1f}%; results/perf_validation.md)"
    )
