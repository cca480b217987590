"""What the throughput and memory validations (recipes/report/perf_validation.py,
recipes/report/memory_validation.py) share: a group of figures' errors, each figure's kind (the
bands, core/dryrun/accuracy.py) and how many held-out figures fall within the band their kind had
before they arrived, a layout in words, and the pages' prose (templates/perf_validation.toml)."""

from __future__ import annotations

import statistics
from importlib import resources

import tomllib

from core.dryrun import accuracy
from core.dryrun.linears import fp8_all_gather

# Issue 35's goals, on the held-out figures: throughput and memory (mean absolute, worst).
HELD_OUT_GOALS = {"throughput": (9.0, 25.0), "memory": (10.0, 25.0)}


def _role(f) -> str:
    return f.role


def errors(figs: list, error=lambda f: f.error_pct) -> dict:
    """Mean absolute and worst error of the figures (`error`: a figure's signed error in %)."""
    if not figs:
        return {"figures": 0}
    worst = max(figs, key=lambda f: abs(error(f)))
    return {
        "figures": len(figs),
        "mean_abs_error_pct": round(statistics.fmean(abs(error(f)) for f in figs), 1),
        "worst_pct": round(error(worst), 1),
        "worst_figure": worst.id,
    }


def _role(f) -> str:
    return f.role


def judged_kinds(figs: list, error=lambda f: f.error_pct, role=_role) -> list[dict]:
    """Each figure's kind (core/dryrun/accuracy.py), signed error and role: what the bands group."""
    return [{"id": f.id, **f.kind, "error_pct": round(error(f), 2), "role": role(f)} for f in figs]


def band_coverage(figs: list, error=lambda f: f.error_pct, role=_role, memory: bool = False) -> str:
    """How many held-out figures fall within the band their kind had before they arrived (drawn
    from the prior and listed figures alone): 'k of n'. `memory`: the memory bands' kinds."""
    before = judged_kinds([f for f in figs if role(f) != "held_out"], error, role)
    held = [f for f in figs if role(f) == "held_out"]
    fields = (accuracy.MEMORY_KIND_FIELDS, accuracy.MEMORY_WIDENING) if memory else ()
    inside = 0
    for f in held:
        b = accuracy.kind_band(f.kind, before, *fields)
        inside += b["mae"] is not None and abs(error(f)) <= b["mae"]
    return f"{inside} of {len(held)}"


def layout(cfg) -> str:
    """FSDP 32 x TP 8, compile, Float8 tensorwise, AsyncTP, full AC, local batch 16, seq 8192."""
    p, t, f = cfg.parallelism, cfg.training, cfg.float8
    dims = [(n, getattr(p, k)) for n, k in (("FSDP", "dp_shard"), ("TP", "tp"), ("PP", "pp"), ("CP", "cp"))]
    parts = [" x ".join(f"{n} {v}" for n, v in dims if v > 1) or "1 GPU"]
    if p.pp > 1:
        parts.append(f"{p.pp_schedule} {p.pp_microbatches or p.pp} microbatches")
    parts.append("compile" if cfg.compile.enabled else "eager")
    if f.enabled:
        parts.append(f"Float8 {f.recipe}" + (" + float8 all-gather" if fp8_all_gather(cfg) else ""))
    if p.enable_async_tp:
        parts.append("AsyncTP")
    if p.fsdp_reshard_after_forward != "default":
        parts.append(f"reshard {p.fsdp_reshard_after_forward}")
    ac = cfg.activation_checkpoint
    parts.append("full AC" if ac.mode == "full" else f"{ac.mode} {ac.selective_ac_option} AC")
    if cfg.model.n_layers:
        parts.append(f"{cfg.model.n_layers} blocks")
    parts.append(f"local batch {t.local_batch_size}, seq {t.seq_len}")
    return ", ".join(parts)


def world(cfg) -> int:
    p = cfg.parallelism
    return p.world_size or p.dp_replicate * p.dp_shard * p.cp * p.tp * p.pp


def template() -> dict:
    path = resources.files("recipes.report") / "templates" / "perf_validation.toml"
    return tomllib.loads(path.read_text(encoding="utf-8"))


def verdict(met: bool) -> str:
    return "met" if met else "not met"


def kinds_table(s: dict, key: str = "judged") -> list[list]:
    """One row per kind of run among the judged figures: how many, their error, the held-out ones
    (the memory readings' kinds also say TP or not)."""
    fields = accuracy.MEMORY_KIND_FIELDS if key == "memory_judged" else accuracy.KIND_FIELDS
    groups: dict[tuple, list[dict]] = {}
    for j in s[key]:
        groups.setdefault(tuple(j[k] for k in fields), []).append(j)
    rows = []
    for k, js in sorted(groups.items(), key=lambda kv: (-len(kv[1]), str(kv[0]))):
        kind = dict(zip(fields, k, strict=True))
        held = [j for j in js if j["role"] == "held_out"]
        mae = statistics.fmean(abs(j["error_pct"]) for j in js)
        worst = max((j["error_pct"] for j in js), key=abs)
        rows.append([accuracy.describe_kind(kind, fields), len(js), f"{mae:.1f}", f"{worst:+.1f}", len(held)])
    return rows


def gpu_rows(by_gpu: dict) -> list[list]:
    """One row per GPU spec of core/dryrun/hardware: its judged figures' count and error, or
    that no judged figure ran on it."""
    from core.dryrun.gpuspec import known_gpus

    rows = []
    for g in sorted(set(known_gpus()) | set(by_gpu)):
        e = by_gpu.get(g)
        if e and e["figures"]:
            rows.append([g, e["figures"], e["mean_abs_error_pct"], f"{e['worst_pct']:+.1f}"])
        else:
            rows.append([g, 0, "-", "no judged public figure"])
    return rows
