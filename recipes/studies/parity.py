"""Loss parity: every N-D layout against the single-process reference, step by step.

Each layout runs the real trainer under torchrun (`recipes.modes.launch_trainer`) on a tiny
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
This module runs and compares; the layouts are in recipes/studies/parity_layouts.py, the tables
it writes in recipes/studies/parity_tables.py.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import click
from tabulate import tabulate

from core.config import load_config
from core.reference import reference_run
from core.validate import validate
from recipes import launcher, modes, paths
from recipes.options import out_dir_option
from recipes.studies.parity_layouts import BASE, TOLERANCE, Layout, select
from recipes.studies.parity_tables import HEADERS, write_results

GROUP_WORKER = "recipes.studies.group_worker"  # runs a group's jobs inside one torchrun


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
    record = modes.launch_trainer(layout.world_size, overrides, out_dir)
    return compare(layout, dtype, record, time.perf_counter() - t0)


def run_grouped(layouts: list[Layout], dtype: str, out_dir: Path, timeout: float = 1800) -> list[dict]:
    """Faster: one torchrun per world size runs all its layouts one after another
    (recipes.studies.group_worker), sparing ~10-20 s of start-up per layout. Losses are those of
    separate runs (each job builds its own mesh, model and data, and core.train.run resets Dynamo
    before it, so it compiles what its own run would), but the peak RSS of a later job includes the
    earlier ones."""
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
        cmd = launcher.torchrun_command(world, ["-m", GROUP_WORKER, str(spec)], forked=True)
        log = spec.with_suffix(".log")
        t0 = time.perf_counter()
        # after a timeout, the jobs that finished have their result.json
        launcher.run_logged(cmd, modes.PROXY.env(world), log, timeout=timeout)
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
    norm_diffs = [abs(a - b) / b for a, b in zip(record["grad_norms"], ref.get("grad_norms", []), strict=False)]
    return {
        "layout": layout.name,
        "world_size": layout.world_size,
        "dtype": dtype,
        "steps": len(diffs),
        "max_abs_diff": max(diffs),
        "tolerance": tol,
        "passed": max(diffs) <= tol,
        "losses": record["losses"],
        "grad_norms": record["grad_norms"],
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


# ----------------------------------------------------------------------------------------- CLI
@click.command("parity")
@click.option("--layouts", default="", help="Comma-separated layout names (default: all). See --list.")
@click.option("--dtype", type=click.Choice(["fp32", "bf16"]), default="fp32", show_default=True)
@click.option("--list", "list_only", is_flag=True, help="List the layouts and exit.")
@out_dir_option("Run directories (default: runs/parity/<dtype>).", name="out")
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
    out_dir = Path(out) if out else paths.default_runs_dir() / "parity" / dtype
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
    click.echo(tabulate(table, headers=HEADERS))
    if rows:
        write_results(rows, Path(results_dir) if results_dir else paths.results_root())
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
