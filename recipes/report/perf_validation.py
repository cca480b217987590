"""The performance model against every public throughput figure we know of (`run-recipe
dry-run-table --validate`): results/perf_validation.csv and .md, and the error band the
predictions print (core/dryrun/accuracy.toml); the memory side is recipes/report/memory_validation.py.

The figures: the paper's (each row's `paper_tps_per_gpu`), torchtitan's Dec 2024 re-run (each
row's `bench_tps_per_gpu`) and the other public measurements in recipes/report/perf_figures.toml, each
with its source, GPU system, full configuration and role: `prior` (the model was built on it),
`listed` (issue 35 names it, or one of its mechanisms was designed against it) or `held_out`
(decided before any issue-35 mechanism was built: the model is judged on these alone). A figure
a constant was fitted on (core/dryrun/calibrate.py) is marked and left out of the error.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

import tomllib
from tabulate import tabulate

from core.dryrun import accuracy, calibrate
from core.dryrun.gpuspec import DEFAULT_GPU
from core.dryrun.stack import config_settings
from core.fileio import atomic_write
from recipes import registry
from recipes.report.validation_parts import (
    HELD_OUT_GOALS,
    band_coverage,
    errors,
    gpu_rows,
    judged_kinds,
    kinds_table,
    layout,
    template,
    verdict,
    world,
)

CSV_COLUMNS = (
    "source",
    "role",
    "model",
    "gpu",
    "gpus",
    "layout",
    "measured_tps_per_gpu",
    "predicted_tps_per_gpu",
    "error_pct",
    "fitted",
    "software",
)
MAE_GOAL_PCT, WORST_GOAL_PCT = 8.0, 20.0
NO_MEM = {"allocated_peak_gib": 0.0}  # memory is not what is validated here
ROLES = ("prior", "listed", "held_out")


@dataclass
class Figure:
    id: str
    source: str
    row: str
    gpu: str
    measured: float
    overrides: tuple[str, ...] = ()
    fitted: bool = False
    outside: str = ""  # why the throughput is shown and never judged (e.g. a GPU outside its spec)
    role: str = "prior"
    designed_for: str = ""
    measured_reserved: float | None = None  # GiB, torch's max reserved as the source logs it
    memory_outside: str = ""  # why the memory reading is shown and never judged
    memory_role: str = ""  # the memory reading's role where it differs from the figure's
    memory_pp_rank: int | None = None  # the pipeline rank the reading is of (else: the worst rank)
    stack: dict = field(default_factory=dict)  # the software's differences (core/dryrun/stack.py)
    software: object = None  # core.dryrun.software.Software: what ran it
    predicted: float | None = None
    predicted_reserved: float | None = None
    peak_at: str = ""  # where the accounting's peak is
    cfg: object = field(default=None, repr=False)

    @property
    def error_pct(self) -> float:
        return (self.predicted / self.measured - 1) * 100

    @property
    def kind(self) -> dict:
        return accuracy.kind_of(self.cfg, self.gpu)


@functools.cache
def data() -> dict:
    return tomllib.loads((resources.files("recipes.report") / "perf_figures.toml").read_text(encoding="utf-8"))


def _reference_figures() -> list[Figure]:
    """The paper's and the Dec 2024 re-run's figures of each row that has one (throughput and memory)."""
    out = []
    for col, key, mem in (
        ("paper", "paper_tps_per_gpu", "paper_mem_gib"),
        ("bench-2412", "bench_tps_per_gpu", "bench_mem_gib"),
    ):
        for r in registry.all_recipes():
            if r.reference.get(key):
                f = Figure(f"{col}/{r.id}", col, r.id, DEFAULT_GPU, float(r.reference[key]))
                f.measured_reserved = r.reference.get(mem)
                f.software, f.stack = _software_and_stack(col, {})
                out.append(f)
    return out


def figures() -> list[Figure]:
    """Every public figure: the paper's and the Dec 2024 re-run's for each row that has one, then
    the others (recipes/report/perf_figures.toml)."""
    out = _reference_figures()
    for f in data()["figures"]:
        if f.get("role", "prior") not in ROLES:
            raise ValueError(f"{f['id']}: role {f['role']!r} is none of {ROLES}")
        out.append(
            Figure(
                f["id"],
                f["source"],
                f["row"],
                f["gpu"],
                float(f["measured_tps_per_gpu"]),
                tuple(f.get("set", ())),
                outside=f.get("outside", ""),
                role=f.get("role", "prior"),
                designed_for=f.get("designed_for", ""),
                measured_reserved=f.get("measured_reserved_gib"),
                memory_outside=f.get("memory_outside", ""),
                memory_role=f.get("memory_role", ""),
                memory_pp_rank=f.get("memory_pp_rank"),
            )
        )
        out[-1].software, out[-1].stack = _software_and_stack(f["source"], f.get("stack", {}))
    fitted = set(calibrate.fitted_figures())
    for f in out:
        f.cfg = registry.resolve_config(registry.get(f.row), "dry-run", config_settings(f.stack, f.overrides))
        # A fit on a figure fits every figure of the same configuration on the same GPU.
        f.fitted = any(g.id in fitted and _same_run(f, g) for g in out)
    return out


def _software_and_stack(source: str, own: dict) -> tuple:
    """A figure's software (its source's `software`) and the stack the model runs it with: what
    the software's versions decide (core/dryrun/software.py), where the source's or the figure's
    own `stack` does not say otherwise (a run whose code differs from its date's)."""
    from core.dryrun.software import of_source, stack_with

    src = data()["sources"][source]
    sw = of_source(src["software"])
    return sw, dataclasses.asdict(stack_with(sw, {**src.get("stack", {}), **own}))


def fit_targets() -> dict[str, tuple[object, float, object]]:
    """For each fitted figure: (its validated config, its measured TPS/GPU, the stack that ran
    it), for calibrate.fit."""
    from core.dryrun.stack import stack_of

    by_id = {f.id: f for f in figures()}
    return {
        fid: (by_id[fid].cfg, by_id[fid].measured, stack_of(by_id[fid].stack)) for fid in calibrate.fitted_figures()
    }


def _same_run(a: Figure, b: Figure) -> bool:
    def priced(f: Figure) -> dict:  # what of its stack the model reads for this config
        return {k: v for k, v in f.stack.items() if k != "sac_saves_abs" or f.cfg.float8.enabled}

    return a.row == b.row and a.overrides == b.overrides and a.gpu == b.gpu and priced(a) == priced(b)


def predict_all(figs: list[Figure]) -> list[Figure]:
    from core.dryrun.runtime import predict
    from core.dryrun.stack import stack_of
    from recipes.report import memory_validation

    for f in figs:
        f.predicted = predict(f.cfg, f.gpu, memory=NO_MEM, stack=stack_of(f.stack))["tokens_per_sec_per_gpu"]
    memory_validation.predict_all(figs)
    return figs


def judged(figs: list[Figure]) -> list[Figure]:
    """The figures the model's error is measured on: neither fitted nor outside their spec's conditions."""
    return [f for f in figs if not f.fitted and not f.outside]


def summary(figs: list[Figure]) -> dict:
    """The error over the judged figures, overall, held out and per GPU system, with each judged
    figure's kind; for the figures outside their spec's conditions on a GPU system nothing judged
    ran on, what they measured against the prediction; the memory side (memory_validation)."""
    from recipes.report import memory_validation

    ok = judged(figs)
    gpus = sorted({f.gpu for f in ok})
    outside: dict[str, dict] = {}
    for f in (f for f in figs if f.outside and f.gpu not in gpus):
        o = outside.setdefault(f.gpu, {"figures": 0, "ratios": [], "why": f.outside})
        o["figures"] += 1
        o["ratios"].append(f.measured / f.predicted)
    held = [f for f in ok if f.role == "held_out"]
    return {
        **errors(ok),
        "fitted": sum(f.fitted for f in figs),
        "held_out": {**errors(held), "within_band": band_coverage(ok)},
        "gpus": {g: errors([f for f in ok if f.gpu == g]) for g in gpus},
        "outside": {
            g: {
                "figures": o["figures"],
                "measured_over_predicted_min": round(min(o["ratios"]), 2),
                "measured_over_predicted_max": round(max(o["ratios"]), 2),
                "why": o["why"],
            }
            for g, o in outside.items()
        },
        "judged": judged_kinds(ok),
        **memory_validation.summary(figs),
    }


def csv_rows(figs: list[Figure]) -> list[dict]:
    """The figures the model is judged against (and the fitted ones, marked): the CSV's rows."""
    return [
        {
            "source": f.id,
            "role": f.role + (f" ({f.designed_for})" if f.designed_for else ""),
            "model": f.cfg.model.flavor,
            "gpu": f.gpu,
            "gpus": world(f.cfg),
            "layout": layout(f.cfg),
            "measured_tps_per_gpu": f.measured,
            "predicted_tps_per_gpu": round(f.predicted, 1),
            "error_pct": round(f.error_pct, 1),
            "fitted": "yes" if f.fitted else "no",
            "software": f.software.short(),
        }
        for f in figs
        if not f.outside
    ]


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


def write(out_dir: Path, figs: list[Figure]) -> tuple[Path, ...]:
    """perf_validation.csv and .md (and memory_validation's) in out_dir; when that is the
    project's results/, also the error band the model states (core/dryrun/accuracy.toml): a
    validation written elsewhere changes nothing the package ships."""
    from recipes.paths import results_root
    from recipes.report import memory_validation
    from recipes.report.results import write_csv

    rows = csv_rows(figs)
    out_dir.mkdir(parents=True, exist_ok=True)
    csv_path, md_path = write_csv(out_dir / "perf_validation.csv", rows, CSV_COLUMNS), out_dir / "perf_validation.md"
    s = summary(figs)
    atomic_write(md_path, _markdown(rows, s, effects(figs), figs))
    mem_paths = memory_validation.write(out_dir, figs, s)
    if out_dir.resolve() == results_root().resolve():
        accuracy.write(s)
    return (csv_path, md_path, *mem_paths)


def _goal_lines(t: dict, s: dict) -> list[str]:
    """The overall goal, and issue 35's held-out goals for throughput and memory."""
    mae_met, worst_met = s["mean_abs_error_pct"] <= MAE_GOAL_PCT, abs(s["worst_pct"]) <= WORST_GOAL_PCT
    lines = [
        t["goal"].format(
            mae_goal=MAE_GOAL_PCT,
            worst_goal=WORST_GOAL_PCT,
            mae_verdict=verdict(mae_met),
            worst_verdict=verdict(worst_met),
            band=accuracy.text(s),
            **{k: v for k, v in s.items() if k in accuracy.KEYS},
        ),
        "",
    ]
    for what, key in (("throughput", "held_out"), ("memory", "memory_held_out")):
        h, (mae_goal, worst_goal) = s[key], HELD_OUT_GOALS[what]
        lines += [
            t["held_out_goal"].format(
                what=what,
                mae_goal=mae_goal,
                worst_goal=worst_goal,
                mae_verdict=verdict(h["mean_abs_error_pct"] <= mae_goal),
                worst_verdict=verdict(abs(h["worst_pct"]) <= worst_goal),
                **h,
            ),
            "",
        ]
    return lines


def _markdown(rows: list[dict], s: dict, effs: list[dict], figs: list[Figure]) -> str:
    t = template()
    lines = [t["title"], "", t["intro"].format(calibration=", ".join(calibrate.describe())), ""]
    lines += _goal_lines(t, s)
    gtab = gpu_rows(s["gpus"])
    lines += [tabulate(gtab, headers=t["gpus_headers"], tablefmt="github"), ""]
    lines += [t["kinds_title"], "", t["kinds_intro"], ""]
    lines += [tabulate(kinds_table(s), headers=t["kinds_headers"], tablefmt="github"), ""]
    lines += [t["figures_title"], ""]
    table = [[r[c] for c in CSV_COLUMNS] for r in rows]
    lines.append(tabulate(table, headers=list(CSV_COLUMNS), tablefmt="github"))
    outside = [f for f in figs if f.outside]
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
    lines += _not_predicted(t)
    lines += _effects_lines(t, effs)
    srcs = data()["sources"]
    lines += ["", t["sources_title"], ""] + [f"- `{k}`: {v['title']}, <{v['url']}>" for k, v in srcs.items()]
    return "\n".join(lines) + "\n"


def _not_predicted(t: dict) -> list[str]:
    def cell(v):
        return ", ".join(f"{x:g}" for x in v) if isinstance(v, list) else f"{v:g}" if v else ""

    rows = [
        [n["id"], n["gpu"], cell(n.get("measured_tps_per_gpu")), cell(n.get("measured_reserved_gib")), n["why"]]
        + [n["url"]]
        for n in data()["not_predicted"]
    ]
    return [
        "",
        t["not_predicted_title"],
        "",
        t["not_predicted_intro"],
        "",
        tabulate(rows, headers=t["not_predicted_headers"], tablefmt="github"),
    ]


def _effects_lines(t: dict, effs: list[dict]) -> list[str]:
    lines = ["", t["effects_title"], "", t["effects_intro"], ""]
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
    return lines + ["", t["effects_summary"].format(counts="; ".join(counts))]
