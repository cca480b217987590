"""Loss parity: every N-D layout against the single-process reference, step by step.

Each layout runs the real trainer under torchrun (`recipes.launcher.launch_trainer`) on a tiny
model and the synthetic token stream; the reference is `core.reference.reference_run` on the same
config in this process. Every layout keeps the global batch at GLOBAL_BATCH sequences (local batch
= GLOBAL_BATCH / dp), so one reference run serves all layouts of a model flavor and dtype, and
every layout is compared with it directly, never chained.

Tolerances (max |loss_layout - loss_reference| over STEPS steps):
- fp32: 1e-5. Only the summation order differs (sharded reductions, ring attention's online
  softmax, pipeline microbatches); measured deviations are ~1e-6 at losses ~8.
- bf16: 1e-3. The layout runs FSDP2 mixed precision (bf16 parameters and activations, fp32
  gradient reduction) or, where there is no FSDP, bf16 autocast, and the reference runs the same
  precision policy (`reference_run(bf16="params" | "autocast")`): what is left is bf16 rounding
  of partial sums in another order (2^-8 relative per rounding, averaged over 512 tokens per
  step). Measured: <= ~1e-4, a 10x margin. Comparing FSDP mixed precision with an autocast
  reference instead mixes in the policy difference itself (autocast keeps the residual stream in
  fp32): measured 2.7e-3, about as far as either is from fp32 (2.1e-3), so it proves nothing.

Gradient clipping is active (max_norm below the measured grad norms) so the sharded norm is
covered too. `run-recipe parity` runs the suite and writes results/loss_parity.{md,csv} and
results/golden/loss_parity_<dtype>.json (per-step losses with the versions that made them).
"""

from __future__ import annotations

import importlib.metadata
import json
import platform
import time
from dataclasses import dataclass, field
from pathlib import Path

import click
import torch
from tabulate import tabulate

from core.config import load_config
from core.parallel.mesh import ParallelDims
from core.reference import reference_run
from core.validate import validate
from recipes import launcher
from recipes.results import read_csv, write_csv

STEPS = 10
GLOBAL_BATCH = 8
SEQ_LEN = 64
TOLERANCE = {"fp32": 1e-5, "bf16": 1e-3}
DTYPE_OVERRIDES = {
    "fp32": ["--training.mixed_precision_param=float32", "--training.mixed_precision_reduce=float32"],
    "bf16": ["--training.mixed_precision_param=bfloat16", "--training.mixed_precision_reduce=float32"],
}
BASE = [
    "--data.dataset=synthetic",
    f"--training.seq_len={SEQ_LEN}",
    f"--training.steps={STEPS}",
    "--optimizer.lr=1e-3",
    "--lr_scheduler.warmup_steps=2",
    "--training.max_norm=0.3",
    "--metrics.progress=false",
    "--job.seed=0",
]
CSV_COLUMNS = ["layout", "world_size", "dtype", "steps", "max_abs_diff", "tolerance", "passed"]
PP_SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")
# flavor per pipeline depth: looped schedules hold 2 stages per rank, one layer each at least
PP_FLAVOR = {2: "tiny4", 4: "tiny8"}
GROUP_WORKER = "recipes.studies.group_worker"  # runs a group's jobs inside one torchrun


# bf16: inductor keeps fused intermediates in fp32 where eager rounds every op to bf16, so FSDP2
# bf16 compiled is 1.6e-3 from the eager reference (1.8e-3 from fp32, eager bf16 2.1e-3);
# emulating eager's roundings it is 9.3e-5, as eager FSDP2. fp32: no effect (exact either way).
COMPILE = ("--compile.enabled=true", "--compile.emulate_precision_casts=true")
FLOAT8_FSDP = (
    "--float8.enabled=true",
    "--float8.enable_fsdp_float8_all_gather=true",
    "--float8.precompute_float8_dynamic_scale_for_fsdp=true",
)
# Float8 layouts vs the fp32 or bf16 reference: float8 e4m3 keeps 3 mantissa bits (2^-4 relative
# rounding per element, vs bf16's 2^-8), so the losses differ by more than summation order.
# Measured on this CPU over 10 steps (tiny model): 1.5e-3 .. 3.0e-3 (FSDP2 + float8 all-gather,
# compiled or not, TP 2 tensorwise / rowwise; bf16 and fp32); 5e-3 is the bound, 1.7x the
# worst measured. Float8 numerics are deterministic here (same kernels, same reduction order).
FLOAT8_TOLERANCE = 5e-3


@dataclass(frozen=True)
class Layout:
    name: str
    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    cp: int = 1
    pp: int = 1
    flavor: str = "tiny"
    extra: tuple[str, ...] = field(default_factory=tuple)
    tolerance: float = 0.0  # 0: TOLERANCE[dtype]; Float8 layouts carry their own (FLOAT8_TOLERANCE)

    @property
    def dims(self) -> ParallelDims:
        """The degrees as the trainer's mesh reads them (one arithmetic for both)."""
        d = ParallelDims(self.dp_replicate, self.dp_shard, self.cp, self.tp, self.pp, world_size=0)
        d.world_size = d.dp * d.non_data_parallel_size
        return d

    @property
    def world_size(self) -> int:
        return self.dims.world_size

    @property
    def dp(self) -> int:
        return self.dims.dp

    @property
    def bf16_mode(self) -> str:
        """How the trainer computes in bf16: FSDP2 mixed precision (whenever FSDP is on), or
        autocast without FSDP."""
        return "params" if self.dims.fsdp_enabled else "autocast"

    def overrides(self, dtype: str) -> list[str]:
        return [
            *BASE,
            *DTYPE_OVERRIDES[dtype],
            f"--model.flavor={self.flavor}",
            f"--training.local_batch_size={GLOBAL_BATCH // self.dp}",
            f"--parallelism.dp_replicate={self.dp_replicate}",
            f"--parallelism.dp_shard={self.dp_shard}",
            f"--parallelism.tp={self.tp}",
            f"--parallelism.cp={self.cp}",
            f"--parallelism.pp={self.pp}",
            *self.extra,
        ]


def _pp_layouts() -> list[Layout]:
    out = []
    for pp in (2, 4):
        for s in PP_SCHEDULES:
            out.append(
                Layout(f"pp{pp}_{s.lower()}", pp=pp, flavor=PP_FLAVOR[pp], extra=(f"--parallelism.pp_schedule={s}",))
            )
    return out


LAYOUTS: list[Layout] = [
    Layout("fsdp2", dp_shard=2),
    Layout("fsdp4", dp_shard=4),
    Layout("fsdp8", dp_shard=8),
    Layout("hsdp2x2", dp_replicate=2, dp_shard=2),
    Layout("tp2", tp=2),
    Layout("tp4", tp=4),
    Layout("fsdp2_tp2", dp_shard=2, tp=2),
    Layout("fsdp4_tp2", dp_shard=4, tp=2),
    Layout("cp2_allgather", cp=2, extra=("--parallelism.cp_rotate_method=allgather",)),
    Layout("cp2_alltoall", cp=2, extra=("--parallelism.cp_rotate_method=alltoall",)),
    Layout("cp4_allgather", cp=4, extra=("--parallelism.cp_rotate_method=allgather",)),
    Layout("cp4_alltoall", cp=4, extra=("--parallelism.cp_rotate_method=alltoall",)),
    Layout("fsdp2_cp2", dp_shard=2, cp=2),
    *_pp_layouts(),
    Layout("fsdp2_tp2_pp2", dp_shard=2, tp=2, pp=2, flavor="tiny4", extra=("--parallelism.pp_schedule=1F1B",)),
    Layout(
        "fsdp2_tp2_pp2_cp2", dp_shard=2, tp=2, pp=2, cp=2, flavor="tiny4", extra=("--parallelism.pp_schedule=1F1B",)
    ),
    # Efficiency toggles (issue: toggles). Per-block compile must keep fp32 parity (1e-5).
    Layout("fsdp2_compile", dp_shard=2, extra=COMPILE),
    Layout("tp2_compile", tp=2, extra=COMPILE),
    Layout("fsdp2_tp2_compile", dp_shard=2, tp=2, extra=COMPILE),
    Layout("fsdp2_tp2_compile_acfull", dp_shard=2, tp=2, extra=COMPILE + ("--activation_checkpoint.mode=full",)),
    # Float8 against the same high-precision reference, with FLOAT8_TOLERANCE.
    Layout("fsdp2_float8", dp_shard=2, extra=FLOAT8_FSDP, tolerance=FLOAT8_TOLERANCE),
    Layout("fsdp2_compile_float8", dp_shard=2, extra=COMPILE + FLOAT8_FSDP, tolerance=FLOAT8_TOLERANCE),
    Layout(
        "tp2_float8_rowwise",
        tp=2,
        extra=("--float8.enabled=true", "--float8.recipe=rowwise"),
        tolerance=FLOAT8_TOLERANCE,
    ),
]
BY_NAME = {layout.name: layout for layout in LAYOUTS}


def select(names: list[str] | None) -> list[Layout]:
    if not names:
        return list(LAYOUTS)
    unknown = [n for n in names if n not in BY_NAME]
    if unknown:
        raise click.BadParameter(
            f"unknown layout(s) {', '.join(unknown)}; valid: {', '.join(BY_NAME)}", param_hint="--layouts"
        )
    return [BY_NAME[n] for n in names]


# ------------------------------------------------------------------------------------ running
_REFERENCE_CACHE: dict[tuple, dict] = {}


def reference(layout: Layout, dtype: str) -> dict:
    """The single-process run of the layout's config (cached per flavor, dtype and bf16 mode: the
    global batch, token order and everything else are the same for every layout)."""
    mode = layout.bf16_mode if dtype == "bf16" else "fp32"
    key = (layout.flavor, dtype, mode)
    if key not in _REFERENCE_CACHE:
        cfg = load_config(None, Layout("ref", flavor=layout.flavor).overrides(dtype))
        cfg = validate(cfg, 1, check_files=False)
        _REFERENCE_CACHE[key] = reference_run(cfg, bf16=mode if dtype == "bf16" else "autocast")
    return _REFERENCE_CACHE[key]


def run_layout(layout: Layout, dtype: str, out_dir: Path) -> dict:
    """Train the layout in its own torchrun, compare with the reference. Returns a result row
    (the CSV columns, plus losses and the per-rank step time and memory of the record)."""
    overrides = layout.overrides(dtype)
    validate(load_config(None, overrides), layout.world_size, check_files=False)  # before spawning
    (Path(out_dir) / "result.json").unlink(missing_ok=True)
    t0 = time.perf_counter()
    record = launcher.launch_trainer(layout.world_size, overrides, out_dir)
    return compare(layout, dtype, record, time.perf_counter() - t0)


def run_grouped(layouts: list[Layout], dtype: str, out_dir: Path, timeout: float = 1800) -> list[dict]:
    """Faster: one torchrun per world size runs all its layouts one after another
    (recipes.studies.group_worker), sparing ~10-20 s of start-up per layout. Losses are those of
    separate runs (each job builds its own mesh, model and data), but the peak RSS of a later job
    includes the earlier ones."""
    rows: dict[str, dict] = {}
    for world in sorted({lay.world_size for lay in layouts}):
        group = [lay for lay in layouts if lay.world_size == world]
        jobs = []
        for lay in group:
            d = (Path(out_dir) / lay.name).resolve()
            d.mkdir(parents=True, exist_ok=True)
            for stale in ("result.json", "error.txt"):
                (d / stale).unlink(missing_ok=True)
            overrides = [*lay.overrides(dtype), f"--job.output_dir={d}"]
            validate(load_config(None, overrides), world, check_files=False)  # before spawning
            jobs.append({"name": lay.name, "overrides": overrides})
        spec = Path(out_dir).resolve() / f"jobs_{dtype}_w{world}.json"
        spec.write_text(json.dumps(jobs, indent=1))
        cmd = launcher.torchrun_command(world, ["-m", GROUP_WORKER, str(spec)])
        log = spec.with_suffix(".log")
        t0 = time.perf_counter()
        # after a timeout, the jobs that finished have their result.json
        launcher.run_logged(cmd, launcher.launch_env("proxy", world), log, timeout=timeout)
        wall = (time.perf_counter() - t0) / len(group)
        for lay in group:
            d = Path(out_dir).resolve() / lay.name
            if (d / "result.json").is_file():
                rows[lay.name] = compare(lay, dtype, json.loads((d / "result.json").read_text()), wall)
                rows[lay.name]["grouped"] = True  # memory includes earlier jobs: not reported
            else:
                err = (
                    (d / "error.txt").read_text()
                    if (d / "error.txt").is_file()
                    else f"no result; log: {log}\n{launcher.log_tail(log, 20)}"
                )
                rows[lay.name] = failed_row(lay, dtype, err)
    return [rows[lay.name] for lay in layouts]


def compare(layout: Layout, dtype: str, record: dict, wall: float) -> dict:
    ref = reference(layout, dtype)
    diffs = [abs(a - b) for a, b in zip(record["losses"], ref["losses"], strict=True)]
    steady = record["step_times_s"][1:] or record["step_times_s"]
    max_norm = next(float(o.split("=")[1]) for o in BASE if o.startswith("--training.max_norm="))
    tol = layout.tolerance or TOLERANCE[dtype]
    # the sharded grad-norm (DTensor placements of FSDP x TP, summed over pp) vs the plain one
    norm_diffs = [abs(a - b) / b for a, b in zip(record["grad_norms"], ref.get("grad_norms", []))]
    return {
        "layout": layout.name,
        "world_size": layout.world_size,
        "dtype": dtype,
        "steps": len(diffs),
        "max_abs_diff": max(diffs),
        "tolerance": tol,
        "passed": max(diffs) <= tol,
        "losses": record["losses"],
        "reference": ref["losses"],
        "step_time_s": sum(steady) / len(steady),
        "peak_memory_gib_per_rank": record["peak_memory_gib_per_rank"],
        "memory_kind": record.get("memory_kind", ""),
        "clipped_steps": sum(g > max_norm for g in record["grad_norms"]),
        "grad_norm_max_rel_diff": max(norm_diffs) if norm_diffs else None,
        "toggles": record.get("toggles_applied", []),
        "overrides": layout.overrides(dtype),
        "launch_wall_s": wall,
        "versions": record.get("versions", {}),
    }


# ------------------------------------------------------------------------------------ writing
def versions() -> dict:
    try:  # the installed version, without importing torchao (its import prints kernel warnings)
        torchao = importlib.metadata.version("torchao")
    except importlib.metadata.PackageNotFoundError:
        torchao = None
    return {"torch": torch.__version__, "python": platform.python_version(), "torchao": torchao}


def write_results(rows: list[dict], results_dir: Path) -> None:
    """Merge rows into results/loss_parity.csv (keyed by layout and dtype), regenerate the
    Markdown table from it, and merge the per-step losses into the golden JSON per dtype."""
    results_dir.mkdir(parents=True, exist_ok=True)
    csv_path, md_path = results_dir / "loss_parity.csv", results_dir / "loss_parity.md"
    detail_path = results_dir / "golden" / "loss_parity_detail.json"
    merged = {(r["layout"], r["dtype"]): r for r in read_csv(csv_path)}
    details = json.loads(detail_path.read_text()) if detail_path.is_file() else {}
    for r in rows:
        merged[(r["layout"], r["dtype"])] = {c: r[c] for c in CSV_COLUMNS}
        if not r["losses"]:
            details[f"{r['layout']}/{r['dtype']}"] = {"error": r.get("error", "")}
            continue
        details[f"{r['layout']}/{r['dtype']}"] = {
            "step_time_s": r["step_time_s"],
            "peak_memory_gib_per_rank": r["peak_memory_gib_per_rank"],
            "memory_kind": r["memory_kind"],
            "clipped_steps": r["clipped_steps"],
            "grad_norm_max_rel_diff": r["grad_norm_max_rel_diff"],
            "grouped": r.get("grouped", False),
        }
    order = {lay.name: i for i, lay in enumerate(LAYOUTS)}
    keyed = sorted(
        merged.values(), key=lambda r: (r["dtype"] != "fp32", r["dtype"], order.get(r["layout"], 1e9), r["layout"])
    )
    write_csv(csv_path, [{c: _fmt_csv(r[c]) for c in CSV_COLUMNS} for r in keyed], CSV_COLUMNS)
    (detail_path.parent).mkdir(parents=True, exist_ok=True)
    detail_path.write_text(json.dumps(details, indent=1, sort_keys=True) + "\n")
    md_path.write_text(markdown(keyed, details))

    for dtype in sorted({r["dtype"] for r in rows}):
        path = results_dir / "golden" / f"loss_parity_{dtype}.json"
        golden = json.loads(path.read_text()) if path.is_file() else {}
        golden.update(
            {
                "dtype": dtype,
                "steps": STEPS,
                "global_batch": GLOBAL_BATCH,
                "seq_len": SEQ_LEN,
                "base_overrides": BASE + DTYPE_OVERRIDES[dtype],
                "parity_tolerance": TOLERANCE[dtype],
                "golden_tolerance": golden_tolerance(dtype),
            }
        )
        layouts = golden.setdefault("layouts", {})
        refs = golden.setdefault("reference", {})
        for r in rows:
            if r["dtype"] != dtype or not r["passed"]:
                continue  # golden losses are those of passing runs only
            layouts[r["layout"]] = {
                "world_size": r["world_size"],
                "losses": r["losses"],
                "versions": r["versions"],
                "overrides": r["overrides"],
            }
            if r["reference"]:
                refs[reference_key(BY_NAME[r["layout"]], dtype)] = r["reference"]
        golden["versions"] = versions()
        path.write_text(json.dumps(golden, indent=1, sort_keys=True) + "\n")


def reference_key(layout: Layout, dtype: str) -> str:
    return f"{layout.flavor}/{layout.bf16_mode}" if dtype == "bf16" else layout.flavor


def golden_tolerance(dtype: str) -> float:
    """Re-runs against the stored golden losses: the parity tolerance (the same code on the same
    versions reproduces them to ~1e-7; another CPU's kernels may sum in another order)."""
    return TOLERANCE[dtype]


def _fmt_csv(v):
    if isinstance(v, float):
        return f"{v:.3e}"
    return v


def markdown(rows: list[dict], details: dict) -> str:
    v = versions()
    lines = [
        "# Loss parity: N-D layouts vs the single-process run",
        "",
        (
            f"Generated by `run-recipe parity` (torch {v['torch']}, torchao {v['torchao']}). Tiny Llama, "
            f"synthetic tokens, seq {SEQ_LEN}, global batch {GLOBAL_BATCH}, {STEPS} AdamW steps with "
            "grad clipping active; max |loss - reference loss| over the steps. fp32 tolerance 1e-5; "
            "bf16 (FSDP2 bf16 params + fp32 reduce, or bf16 autocast without FSDP, vs the reference "
            "under the same bf16 policy) 1e-3. Step time: mean over steps 2..N (CPU, gloo, OMP_NUM_THREADS=1 "
            "per rank on a shared 2-core machine: relative, not absolute). Memory: peak RSS per rank "
            "(includes ~0.4 GB of process baseline; blank when measured with --grouped). Per-step "
            "losses and the versions that made them: results/golden/loss_parity_<dtype>.json."
        ),
        "",
        (
            "Why the bf16 reference follows the layout's policy: FSDP2 mixed precision computes the "
            "whole block in bf16 while autocast keeps the residual stream in fp32; measured on this "
            "suite, FSDP2 bf16 vs an autocast reference differs by 2.7e-3 (either is ~2e-3 from fp32), "
            "FSDP2 bf16 vs a reference with bf16 parameter copies by 9e-5."
        ),
        "",
        (
            "Grad-norm rel diff: max over steps of |norm - reference norm| / reference norm, the "
            "check on the sharded grad-norm clipping (AdamW hardly sees clipping's uniform scale, so "
            "the losses alone would not). In fp32 torch's CPU norm of the largest gradient is itself "
            "~1e-4 from float64, the bound of this check; a replicated weight counted twice moves it ~1%."
        ),
        "",
    ]
    table = []
    for r in rows:
        d = details.get(f"{r['layout']}/{r['dtype']}", {})
        mem = d.get("peak_memory_gib_per_rank") or []
        table.append(
            [
                r["layout"],
                r["world_size"],
                r["dtype"],
                r["steps"],
                _fmt_csv(float(r["max_abs_diff"])),
                _fmt_csv(float(r["tolerance"])),
                "run failed" if "error" in d else r["passed"],
                f"{d['step_time_s']:.3f}" if "step_time_s" in d else "",
                f"{max(mem) * 1024:.0f}" if mem and not d.get("grouped") else "",
                d.get("clipped_steps", ""),
                _fmt_csv(d["grad_norm_max_rel_diff"]) if d.get("grad_norm_max_rel_diff") is not None else "",
            ]
        )
    lines.append(
        tabulate(
            table,
            headers=[
                "layout",
                "world",
                "dtype",
                "steps",
                "max abs diff",
                "tolerance",
                "passed",
                "step s",
                "peak MB/rank",
                "clipped steps",
                "grad-norm rel diff",
            ],
            tablefmt="github",
        )
    )
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------------------- CLI
@click.command("parity")
@click.option("--layouts", default="", help="Comma-separated layout names (default: all). See --list.")
@click.option("--dtype", type=click.Choice(["fp32", "bf16"]), default="fp32", show_default=True)
@click.option("--list", "list_only", is_flag=True, help="List the layouts and exit.")
@click.option(
    "--out", type=click.Path(file_okay=False), default=None, help="Run directories (default: runs/parity/<dtype>)."
)
@click.option(
    "--results-dir",
    type=click.Path(file_okay=False),
    default=None,
    help="Where loss_parity.{md,csv} and golden/ go (default: results/).",
)
@click.option(
    "--grouped",
    is_flag=True,
    help="One torchrun per world size for all its layouts: much faster; the losses are the "
    "same, but peak memory then includes earlier jobs of the group.",
)
def parity(layouts, dtype, list_only, out, results_dir, grouped):
    """Loss parity of N-D layouts against the single-process run (tiny model, 10 steps)."""
    chosen = select([n.strip() for n in layouts.split(",") if n.strip()])
    if list_only:
        click.echo(
            tabulate(
                [[lay.name, lay.world_size, lay.flavor, " ".join(lay.extra)] for lay in chosen],
                headers=["layout", "world", "flavor", "extra"],
            )
        )
        return
    out_dir = Path(out) if out else launcher.default_runs_dir() / "parity" / dtype
    rows = []
    if grouped:
        click.echo(f"[parity] {len(chosen)} layouts, one torchrun per world size ...", err=True)
        rows = run_grouped(chosen, dtype, out_dir)
    for layout in [] if grouped else chosen:
        click.echo(f"[parity] {layout.name} (world {layout.world_size}, {dtype}) ...", err=True)
        try:
            row = run_layout(layout, dtype, out_dir / layout.name)
        except Exception as e:  # noqa: BLE001 - a failed layout is a row, the suite goes on
            rows.append(failed_row(layout, dtype, str(e)))
            click.echo(
                f"[parity] {layout.name} FAILED: {str(e).splitlines()[0]}\n"
                f"          log: {out_dir / layout.name / 'train.log'}",
                err=True,
            )
            continue
        rows.append(row)
        click.echo(
            f"[parity] {layout.name}: max abs diff {row['max_abs_diff']:.2e} "
            f"({'ok' if row['passed'] else 'FAIL'}), {row['launch_wall_s']:.0f} s",
            err=True,
        )
    table = [
        [
            r["layout"],
            r["world_size"],
            r["dtype"],
            r["steps"],
            f"{r['max_abs_diff']:.2e}",
            f"{r['tolerance']:.0e}",
            r["passed"] if r["losses"] else "run failed",
            f"{r['step_time_s']:.3f}" if r["losses"] else "",
            f"{max(r['peak_memory_gib_per_rank']) * 1024:.0f}" if r["losses"] else "",
        ]
        for r in rows
    ]
    click.echo(
        tabulate(
            table,
            headers=[
                "layout",
                "world",
                "dtype",
                "steps",
                "max abs diff",
                "tolerance",
                "passed",
                "step s",
                "peak MB/rank",
            ],
        )
    )
    if rows:
        write_results(rows, Path(results_dir) if results_dir else launcher.results_root())
    if not all(r["passed"] for r in rows):
        raise SystemExit(1)


def failed_row(layout: Layout, dtype: str, error: str) -> dict:
    """A layout whose run failed: recorded as not passed (max_abs_diff nan), never left out."""
    return {
        "layout": layout.name,
        "world_size": layout.world_size,
        "dtype": dtype,
        "steps": 0,
        "max_abs_diff": float("nan"),
        "tolerance": layout.tolerance or TOLERANCE[dtype],
        "passed": False,
        "losses": [],
        "reference": [],
        "error": error.splitlines()[0] if error else "",
    }
