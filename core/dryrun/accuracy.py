"""The performance model's measured error band: the mean absolute error and the worst error of its
predictions over the public figures it was not fitted to (results/perf_validation.md), overall, on
each GPU system and for each kind of run. A GPU system no judged figure ran on says so, with what
the public figures outside its spec's conditions measured (e.g. power-limited parts), instead of
borrowing another system's band.

A prediction's own band is the error over the judged figures of its kind: the GPU system, the
precision (bf16, or the Float8 recipe and whether FSDP gathers in float8), compile, the AC mode,
PP and CP. Where fewer than `HANDFUL` figures are of its kind, the band says how many are and
widens: it drops the kind's fields in `WIDENING` order until a handful remain, and is never
narrower than the error of the figures of its own kind.

`run-recipe dry-run-table --validate` measures it and writes core/dryrun/accuracy.toml; the
dry-run record, `run-recipe plan` and the tables print it beside each prediction.
"""

from __future__ import annotations

import functools
import statistics
from pathlib import Path

import tomllib

from core.fileio import atomic_write

PATH = Path(__file__).with_name("accuracy.toml")
KEYS = ("figures", "fitted", "mean_abs_error_pct", "worst_pct", "worst_figure")
GPU_KEYS = ("figures", "mean_abs_error_pct", "worst_pct")
OUTSIDE_KEYS = ("figures", "measured_over_predicted_min", "measured_over_predicted_max", "why")
KIND_FIELDS = ("gpu", "precision", "compile", "ac", "pp", "cp")
# The fields a band drops, in order, while fewer than a handful of figures are of its kind.
WIDENING = (("ac",), ("pp", "cp"), ("compile",), ("gpu",), ("precision",))
# A memory band's kind also says whether TP splits the activations (what a TP rank keeps differs
# by mechanism, core/dryrun/activations.py); dropped first while a handful is not reached.
MEMORY_KIND_FIELDS = (*KIND_FIELDS, "tp")
MEMORY_WIDENING = (("tp",), *WIDENING)
HANDFUL = 5


def kind_of(cfg, gpu: str) -> dict:
    """The kind of run a config is, as the bands group the public figures."""
    from core.dryrun.linears import fp8_all_gather

    f, p, ac = cfg.float8, cfg.parallelism, cfg.activation_checkpoint
    precision = "bf16"
    if f.enabled:
        precision = f"Float8 {f.recipe}" + (" + float8 all-gather" if fp8_all_gather(cfg) else "")
    acs = {"none": "no AC", "full": "full AC"}
    return {
        "gpu": gpu,
        "precision": precision,
        "compile": "compile" if cfg.compile.enabled else "eager",
        "ac": acs.get(ac.mode) or ("op SAC" if ac.selective_ac_option == "op" else "layer SAC"),
        "pp": p.pp > 1,
        "cp": p.cp > 1,
        "tp": p.tp > 1,
    }


def describe_kind(kind: dict, fields=KIND_FIELDS) -> str:
    """'h100_96gb_hbm2e_500w, Float8 tensorwise, eager, op SAC, no PP, no CP'."""
    names = {"pp": ("PP", "no PP"), "cp": ("CP", "no CP"), "tp": ("TP", "no TP")}
    return ", ".join(
        (names[k][0] if kind[k] else names[k][1]) if k in names else str(kind[k]) for k in fields if k in kind
    )


def _value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    return f'"{v}"' if isinstance(v, str) else str(v)


def _table(name: str, d: dict, keys) -> list[str]:
    return ["", f"[{name}]"] + [f"{k} = {_value(d[k])}" for k in keys if k in d]


def write(summary: dict) -> None:
    """accuracy.toml from the validation's summary (recipes/report/perf_validation.summary): the
    overall, held-out and per-GPU errors, and every judged figure's kind and error (the bands)."""
    lines = ["# Written by `run-recipe dry-run-table --validate` (recipes/report/perf_validation.py): do not edit."]
    lines += [f"{k} = {_value(summary[k])}" for k in KEYS]
    lines.append("judged = [")  # a top-level key: before the first [table]
    for j in summary.get("judged", []):
        fields = ", ".join(f"{k} = {_value(j[k])}" for k in ("id", *KIND_FIELDS, "error_pct", "role"))
        lines.append(f"  {{ {fields} }},")
    lines.append("]")
    lines.append("memory_judged = [")
    for j in summary.get("memory_judged", []):
        fields = ", ".join(f"{k} = {_value(j[k])}" for k in ("id", *MEMORY_KIND_FIELDS, "error_pct", "role"))
        lines.append(f"  {{ {fields} }},")
    lines.append("]")
    for name in ("held_out", "memory", "memory_held_out"):
        if summary.get(name):
            lines += _table(name, summary[name], (*KEYS, "within_band"))
    for gpu, g in sorted(summary.get("gpus", {}).items()):
        lines += _table(f"gpus.{gpu}", g, GPU_KEYS)
    for gpu, g in sorted(summary.get("outside", {}).items()):
        lines += _table(f"outside.{gpu}", g, OUTSIDE_KEYS)
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


def _errors(figs: list[dict]) -> tuple[float, float]:
    worst = max((f["error_pct"] for f in figs), key=abs)
    return statistics.fmean(abs(f["error_pct"]) for f in figs), worst


def kind_band(kind: dict, judged: list[dict], fields=KIND_FIELDS, widening=WIDENING) -> dict:
    """The band of a kind over `judged` (dicts with `fields` and error_pct): its own figures'
    error where a handful back it; else, widened (`widening`), the error of the first wider group
    of a handful, never narrower than its own figures' error. Keys: mae, worst, figures, own (its
    own figures' count), over (the fields the band is drawn over)."""
    fields = list(fields)
    own = [j for j in judged if all(j.get(k) == kind[k] for k in fields)]
    group = own
    for drop in widening:
        if len(group) >= HANDFUL:
            break
        fields = [k for k in fields if k not in drop]
        group = [j for j in judged if all(j.get(k) == kind[k] for k in fields)]
    if not group:
        return {"mae": None, "worst": None, "figures": 0, "own": 0, "over": fields}
    mae, worst = _errors(group)
    if own and group is not own:
        own_mae, own_worst = _errors(own)
        mae = max(mae, own_mae)
        worst = max(worst, own_worst, key=abs)
    return {"mae": mae, "worst": worst, "figures": len(group), "own": len(own), "over": fields}


def _kind_clause(s: dict, kind: dict) -> str:
    b = kind_band(kind, s.get("judged", []))
    if b["mae"] is None:
        return "; no judged public figure of its kind"
    own = f"{b['own']} public figure{'s' if b['own'] != 1 else ''} of its kind ({describe_kind(kind)})"
    if b["over"] == list(KIND_FIELDS):
        return f"; over the {own}: ±{b['mae']:.1f}%, worst {b['worst']:+.1f}%"
    wider = describe_kind(kind, b["over"]) or "every kind"
    return (
        f"; only {own}, fewer than {HANDFUL}: widened to the {b['figures']} of {wider}: "
        f"±{b['mae']:.1f}%, worst {b['worst']:+.1f}%"
    )


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


def text(summary: dict | None = None, gpu: str | None = None, kind: dict | None = None) -> str:
    """'±7.1% (mean absolute error over 44 public figures; worst -18.0%; on h100_sxm_80gb: ±5.0%
    over 2, worst +9.0%; over the 6 public figures of its kind (...): ±4.2%, worst -7.0%;
    results/perf_validation.md)'."""
    s = summary if summary is not None else band()
    if not s:
        return "error band not measured yet (run-recipe dry-run-table --validate)"
    gpu = gpu or (kind or {}).get("gpu")
    return (
        f"±{s['mean_abs_error_pct']:.1f}% (mean absolute error over {s['figures']} public figures; "
        f"worst {s['worst_pct']:+.1f}%{_gpu_clause(s, gpu) if gpu else ''}"
        f"{_kind_clause(s, kind) if kind else ''}; results/perf_validation.md)"
    )


def memory_band(kind: dict, summary: dict | None = None) -> dict:
    """The memory accounting's band for a kind of run (kind_of): kind_band over the judged memory
    readings (results/memory_validation.md), TP included in the kind. mae None before a validation."""
    s = summary if summary is not None else band()
    return kind_band(kind, (s or {}).get("memory_judged", []), MEMORY_KIND_FIELDS, MEMORY_WIDENING)
