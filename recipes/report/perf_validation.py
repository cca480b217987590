"""The performance model against every public throughput figure we know of (`run-recipe
dry-run-table --validate`): results/perf_validation.csv and .md, and the error band the
predictions print (core/dryrun/accuracy.toml).

The figures: the paper's (each row's `paper_tps_per_gpu`), torchtitan's Dec 2024 re-run (each
row's `bench_tps_per_gpu`) and the other public measurements in recipes/report/perf_figures.toml, each
with its source, GPU system and full configuration. A figure a constant was fitted on
(core/dryrun/calibrate.py) is marked and left out of the error.
"""

from __future__ import annotations

import functools
import statistics
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

import tomllib
from tabulate import tabulate

from core.dryrun import accuracy, calibrate
from core.dryrun.gpuspec import DEFAULT_GPU
from core.fileio import atomic_write
from recipes import registry

CSV_COLUMNS = (
    "source",
    "model",
    "gpu",
    "gpus",
    "layout",
    "measured_tps_per_gpu",
    "predicted_tps_per_gpu",
    "error_pct",
    "fitted",
)
MAE_GOAL_PCT, WORST_GOAL_PCT = 8.0, 20.0
NO_MEM = {"allocated_peak_gib": 0.0}  # memory is not what is validated here


@dataclass
class Figure:
    id: str
    source: str
    row: str
    gpu: str
    measured: float
    overrides: tuple[str, ...] = ()
    fitted: bool = False
    outside: str = ""  # why the figure ran outside its spec's conditions (shown, never judged)
    predicted: float | None = None
    cfg: object = field(default=None, repr=False)

    @property
    def error_pct(self) -> float:
        return (self.predicted / self.measured - 1) * 100


@functools.cache
def data() -> dict:
    return tomllib.loads((resources.files("recipes.report") / "perf_figures.toml").read_text(encoding="utf-8"))


def figures() -> list[Figure]:
    """Every public figure: the paper's and the Dec 2024 re-run's for each row that has one, then
    the others (recipes/report/perf_figures.toml)."""
    out = []
    for col, key in (("paper", "paper_tps_per_gpu"), ("bench-2412", "bench_tps_per_gpu")):
        for r in registry.all_recipes():
            if r.reference.get(key):
                out.append(Figure(f"{col}/{r.id}", col, r.id, DEFAULT_GPU, float(r.reference[key])))
    for f in data()["figures"]:
        measured = float(f["measured_tps_per_gpu"])
        out.append(
            Figure(
                f["id"], f["source"], f["row"], f["gpu"], measured, tuple(f.get("set", ())), False, f.get("outside", "")
            )
        )
    fitted = set(calibrate.fitted_figures())
    for f in out:
        f.cfg = registry.resolve_config(registry.get(f.row), "dry-run", list(f.overrides))
        # A fit on a figure fits every figure of the same configuration on the same GPU.
        f.fitted = any(g.id in fitted and _same_run(f, g) for g in out)
    return out


def fit_targets() -> dict[str, tuple[object, float]]:
    """For each fitted figure: (its validated config, its measured TPS/GPU), for calibrate.fit."""
    by_id = {f.id: f for f in figures()}
    return {fid: (by_id[fid].cfg, by_id[fid].measured) for fid in calibrate.fitted_figures()}


def _same_run(a: Figure, b: Figure) -> bool:
    return a.row == b.row and a.overrides == b.overrides and a.gpu == b.gpu


def predict_all(figs: list[Figure]) -> list[Figure]:
    from core.dryrun.runtime import predict

    for f in figs:
        f.predicted = predict(f.cfg, f.gpu, memory=NO_MEM)["tokens_per_sec_per_gpu"]
    return figs


def judged(figs: list[Figure]) -> list[Figure]:
    """The figures the model's error is measured on: neither fitted nor outside their spec's conditions."""
    return [f for f in figs if not f.fitted and not f.outside]


def _errors(figs: list[Figure]) -> dict:
    worst = max(figs, key=lambda f: abs(f.error_pct))
    return {
        "figures": len(figs),
        "mean_abs_error_pct": round(statistics.fmean(abs(f.error_pct) for f in figs), 1),
        "worst_pct": round(worst.error_pct, 1),
        "worst_figure": worst.id,
    }


def summary(figs: list[Figure]) -> dict:
    """The error over the judged figures, overall and per GPU system; for the figures outside
    their spec's conditions, what they measured against the prediction, per GPU system."""
    ok = judged(figs)
    gpus = sorted({f.gpu for f in ok})
    outside: dict[str, dict] = {}
    for f in (f for f in figs if f.outside):
        o = outside.setdefault(f.gpu, {"figures": 0, "ratios": [], "why": f.outside})
        o["figures"] += 1
        o["ratios"].append(f.measured / f.predicted)
    return {
        **_errors(ok),
        "fitted": sum(f.fitted for f in figs),
        "gpus": {g: _errors([f for f in ok if f.gpu == g]) for g in gpus},
        "outside": {
            g: {
                "figures": o["figures"],
                "measured_over_predicted_min": round(min(o["ratios"]), 2),
                "measured_over_predicted_max": round(max(o["ratios"]), 2),
                "why": o["why"],
            }
            for g, o in outside.items()
        },
    }


def layout(cfg) -> str:
    """FSDP 32 x TP 8, compile, Float8 tensorwise, AsyncTP, full AC, local batch 16, seq 8192."""
    p, t, f = cfg.parallelism, cfg.training, cfg.float8
    dims = [(n, getattr(p, k)) for n, k in (("FSDP", "dp_shard"), ("TP", "tp"), ("PP", "pp"), ("CP", "cp"))]
    parts = [" x ".join(f"{n} {v}" for n, v in dims if v > 1) or "1 GPU"]
    if p.pp > 1:
        parts.append(f"{p.pp_schedule} {p.pp_microbatches or p.pp} microbatches")
    parts.append("compile" if cfg.compile.enabled else "eager")
    if f.enabled:
        parts.append(f"Float8 {f.recipe}" + (" + float8 all-gather" if f.enable_fsdp_float8_all_gather else ""))
    if p.enable_async_tp:
        parts.append("AsyncTP")
    ac = cfg.activation_checkpoint
    parts.append("full AC" if ac.mode == "full" else f"{ac.mode} {ac.selective_ac_option} AC")
    parts.append(f"local batch {t.local_batch_size}, seq {t.seq_len}")
    return ", ".join(parts)


def csv_rows(figs: list[Figure]) -> list[dict]:
    """The figures the model is judged against (and the fitted ones, marked): the CSV's rows."""
    return [
        {
            "source": f.id,
            "model": f.cfg.model.flavor,
            "gpu": f.gpu,
            "gpus": f.cfg.parallelism.world_size or _world(f.cfg),
            "layout": layout(f.cfg),
            "measured_tps_per_gpu": f.measured,
            "predicted_tps_per_gpu": round(f.predicted, 1),
            "error_pct": round(f.error_pct, 1),
            "fitted": "yes" if f.fitted else "no",
        }
        for f in figs
        if not f.outside
    ]


def _world(cfg) -> int:
    p = cfg.parallelism
    return p.dp_replicate * p.dp_shard * p.cp * p.tp * p.pp


def effects(figs: list[Figure]) -> list[dict]:
    """recipes/report/perf_figures.toml's effects (one figure over another, x 100), measured vs predicted."""
    by_id = {f.id: f for f in figs}
    out = []
    for e in data()["effects"]:
        new, old = by_id[e["new"]], by_id[e["old"]]
        meas, pred = new.measured / old.measured * 100, new.predicted / old.predicted * 100
        out.append(
            {
                "effect": e["label"],
                "measured": round(meas, 1),
                "predicted": round(pred, 1),
                "points": round(pred - meas, 1),
                "goal_pp": e["goal_pp"],
                "met": abs(pred - meas) <= e["goal_pp"],
            }
        )
    return out


def write(out_dir: Path, figs: list[Figure]) -> tuple[Path, Path]:
    """perf_validation.csv and .md in out_dir; when that is the project's results/, also the error
    band the model states (core/dryrun/accuracy.toml): a validation written elsewhere changes nothing
    the package ships."""
    from recipes.paths import results_root
    from recipes.report.results import write_csv

    rows = csv_rows(figs)
    out_dir.mkdir(parents=True, exist_ok=True)
    csv_path, md_path = write_csv(out_dir / "perf_validation.csv", rows, CSV_COLUMNS), out_dir / "perf_validation.md"
    s = summary(figs)
    atomic_write(md_path, _markdown(rows, s, effects(figs), [f for f in figs if f.outside]))
    if out_dir.resolve() == results_root().resolve():
        accuracy.write(s)
    return csv_path, md_path


def _markdown(rows: list[dict], s: dict, effs: list[dict], outside: list[Figure]) -> str:
    template = resources.files("recipes.report") / "templates" / "perf_validation.toml"
    t = tomllib.loads(template.read_text(encoding="utf-8"))
    mae_met, worst_met = s["mean_abs_error_pct"] <= MAE_GOAL_PCT, abs(s["worst_pct"]) <= WORST_GOAL_PCT
    lines = [t["title"], "", t["intro"].format(calibration=", ".join(calibrate.describe())), ""]
    lines += [
        t["goal"].format(
            mae_goal=MAE_GOAL_PCT,
            worst_goal=WORST_GOAL_PCT,
            mae_verdict="met" if mae_met else "not met",
            worst_verdict="met" if worst_met else "not met",
            band=accuracy.text(s),
            **s,
        ),
        "",
    ]
    gtab = [[g, e["figures"], e["mean_abs_error_pct"], f"{e['worst_pct']:+.1f}"] for g, e in s["gpus"].items()]
    lines += [tabulate(gtab, headers=t["gpus_headers"], tablefmt="github"), ""]
    table = [[r[c] for c in CSV_COLUMNS] for r in rows]
    lines.append(tabulate(table, headers=list(CSV_COLUMNS), tablefmt="github"))
    if outside:
        lines += ["", t["outside_title"], "", t["outside_intro"], ""]
        otab = [
            [
                f.id,
                f.gpu,
                layout(f.cfg),
                f.measured,
                round(f.predicted, 1),
                round(f.measured / f.predicted, 2),
                f.outside,
            ]
            for f in outside
        ]
        lines.append(tabulate(otab, headers=t["outside_headers"], tablefmt="github"))
    lines += ["", t["effects_title"], "", t["effects_intro"], ""]
    etab = [
        [
            e["effect"],
            e["measured"],
            e["predicted"],
            f"{e['points']:+.1f}",
            e["goal_pp"],
            "met" if e["met"] else "missed",
        ]
        for e in effs
    ]
    lines.append(tabulate(etab, headers=t["effects_headers"], tablefmt="github"))
    kinds = [("AsyncTP", "AsyncTP ratios"), ("Float8", "Float8 recipe effects")]
    counts = [
        f"{label} {sum(e['met'] for e in effs if e['effect'].startswith(k))} of "
        f"{sum(e['effect'].startswith(k) for e in effs)}"
        for k, label in kinds
    ]
    lines += ["", t["effects_summary"].format(counts="; ".join(counts))]
    srcs = data()["sources"]
    lines += ["", t["sources_title"], ""] + [f"- `{k}`: {v['title']}, <{v['url']}>" for k, v in srcs.items()]
    lines += ["", t["not_used"], ""]
    return "\n".join(lines)
