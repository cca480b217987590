"""`run-recipe convergence`: the four loss-convergence rows as CPU proxies, plotted and checked.

The paper trains Llama 3.1 8B for 3,000 steps in four layouts (1D FSDP; 3D FSDP+TP+PP with
compile, Float8, AsyncTP, Interleaved 1F1B; the 3D run + CP; FSDP+CP) and shows the loss
curves overlap. Here each row's proxy (see llama3_8b/loss_convergence/defaults.toml: tiny4,
seq 128, FSDP 2 x local batch 4 in every layout, BF16 params + FP32 reduce, 500 steps, warmup
100) runs through the normal launcher (torchrun -> core.train; the record is copied to
results/records/proxy/). Then the loss-convergence table, curves, plot and check are made from
the records (recipes/report/loss_curves.py; no other table is touched), and, for full-length runs
of every row, this writes

    results/golden/loss_convergence.json   per-step losses + versions

whose first PREFIX_STEPS steps tests/test_convergence.py re-runs on every CI run. `--out DIR` is
the root of everything it writes: the run folders (DIR/runs/<id__>), the records (DIR/records,
unless --records-dir) and the outputs. A row's folder that holds this same run (an interrupted
one) resumes from its latest checkpoint; one of another run is refused before anything runs.
"""

from __future__ import annotations

import datetime
import json
import shlex
import sys
import time
from pathlib import Path

import click

from core import run_folder
from core.config import ConfigError, JobConfig, flatten_keys, load_config
from core.fileio import atomic_write_json
from recipes import launcher, modes, options, paths, registry
from recipes.options import check_writable, refuse
from recipes.output import Stopped, stop_on_signals
from recipes.report import results, table_data
from recipes.report.compliance import file_record
from recipes.report.loss_curves import TOLERANCE, check, column, control, record_label, rows
from recipes.schema import Recipe

# Regression prefix: the first PREFIX_STEPS steps of each row, re-run on every CI run, must match
# the golden prefix within PREFIX_TOLERANCE (nats, per step). The steps lie inside the warmup, whose
# LR does not depend on training.steps, so a short run is exactly the long run's prefix. Five steps:
# the first compile is most of a prefix's time, each further step of the 4D row ~4 s on 2 cores.
PREFIX_STEPS = 5
PREFIX_TOLERANCE = 2e-3


# ------------------------------------------------------------------------------------ running
def warmup_for(steps: int, recipe: Recipe | None = None) -> int:
    """The recipe's warmup:steps ratio (the paper's 600:3000) applied to `steps`."""
    cfg = (recipe or control()).job_config("proxy")
    return max(1, round(steps * cfg.lr_scheduler.warmup_steps / cfg.training.steps))


def prefix_overrides(k: int = PREFIX_STEPS) -> list[str]:
    """Overrides that make a run exactly the first k steps of the full-length proxy run."""
    cfg = control().job_config("proxy")
    if k > cfg.lr_scheduler.warmup_steps:
        raise ValueError(
            f"a {k}-step prefix leaves the warmup ({cfg.lr_scheduler.warmup_steps} "
            "steps), where the LR depends on training.steps"
        )
    return [f"training.steps={k}", "metrics.progress=false"]


# Long runs checkpoint every RESUME_INTERVAL steps and, when the trainer dies (a rank or the
# torchrun agent killed from outside, as happens on a shared machine), are relaunched in the same
# directory, where the trainer resumes from its latest complete checkpoint (exact resume: model,
# optimizer, LR schedule, data position, RNG). The per-step losses of all attempts come from
# metrics.jsonl (log_freq 1); steps logged twice must agree, which checks the resume.
RESUME_INTERVAL = 50
RESUME_ATTEMPTS = 5
RESUME_OVERRIDES = [
    "checkpoint.enabled=true",
    f"checkpoint.interval={RESUME_INTERVAL}",
    "checkpoint.keep_latest_k=1",
    "metrics.log_freq=1",
]


def _stitch(run_dir: Path, record: dict, attempts: int) -> dict:
    """A resumed run's record with the losses of every attempt (steps 1..N) from metrics.jsonl."""
    seen: dict[int, list[float]] = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        seen.setdefault(int(row["step"]), []).append(float(row["loss"]))
    steps = int(record["start_step"]) + len(record["losses"])
    missing = [s for s in range(1, steps + 1) if s not in seen]
    if missing:
        raise RuntimeError(f"{run_dir}: metrics.jsonl lacks steps {missing[:5]}... to stitch the resumed run")
    overlap = max((abs(v[-1] - v[0]) for v in seen.values() if len(v) > 1), default=0.0)
    record = dict(record)
    record["resumed"] = {
        "attempts": attempts,
        "last_start_step": record["start_step"],
        "replayed_steps_max_abs_diff": overlap,
        "note": "losses of steps before start_step are the earlier attempts' (metrics.jsonl)",
    }
    record["losses"] = [seen[s][-1] for s in range(1, steps + 1)]
    record["steps"] = steps
    record["start_step"] = 0
    return record


def row_config(recipe: Recipe, overrides: list[str], resumable: bool = False) -> JobConfig:
    """The row's proxy config with the run's overrides (and the resume's, `resumable`)."""
    extra = RESUME_OVERRIDES if resumable else []
    return registry.resolve_config(recipe, "proxy", [*overrides, *extra], check_files=True)


def other_run_in(run_dir: Path, cfg: JobConfig) -> str | None:
    """What makes the run already in `run_dir` another run than `cfg`'s (the keys whose values
    differ), or None when the folder is empty, new, or holds this very run (which then resumes)."""
    job = Path(run_dir) / "job.json"
    if not job.is_file():
        return "no job.json: not a run of this command" if Path(run_dir).is_dir() and any(run_dir.iterdir()) else None
    try:
        theirs = flatten_keys(load_config(str(job)).to_dict())
    except ConfigError as e:
        return str(e)
    ours = flatten_keys(cfg.to_dict())
    keys = [k for k in ours if k != "job.output_dir" and theirs.get(k) != ours[k]]
    return ", ".join(f"{k} {theirs.get(k)!r} there, {ours[k]!r} here" for k in keys[:3]) or None


def run_row(
    recipe: Recipe,
    overrides: list[str],
    run_dir: Path | None = None,
    records_dir: Path | None = None,
    echo: bool = True,
    resumable: bool = False,
) -> tuple[dict, float]:
    """One proxy run of a row through the launcher (as `run-recipe run ID --mode proxy`).
    resumable: checkpoint and relaunch after a failure (see RESUME_INTERVAL); a run_dir that
    holds this very run resumes from its latest checkpoint (a finished one is reused as it is),
    one of another run is refused (ConfigError). Returns (record, wall seconds of all attempts).
    Raises RuntimeError with the log's tail on failure."""
    cfg = row_config(recipe, overrides, resumable)
    if resumable and run_dir is not None and (other := other_run_in(Path(run_dir), cfg)):
        raise ConfigError(f"{run_dir}: holds another run ({other}): give another --out, or move it away")
    run_dir = run_folder.make(recipe.fname, run_dir, False, paths.default_runs_dir())
    with run_folder.lock(run_dir):  # owned while it runs, as `run-recipe run` owns its folder
        finished = _finished(run_dir, cfg) if resumable else None
        if finished is not None:
            _file(run_dir / "result.json", records_dir, recipe)
            return finished, 0.0
        run_folder.check_resume(cfg, run_dir)
        return _attempts(recipe, cfg, run_dir, records_dir, echo, resumable)


def _finished(run_dir: Path, cfg: JobConfig) -> dict | None:
    """The record of this run when it already ran every step (its folder resumed after the end)."""
    try:
        record = json.loads((run_dir / "result.json").read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return record if record.get("steps") == cfg.training.steps and not record.get("start_step") else None


def _attempts(
    recipe: Recipe, cfg: JobConfig, run_dir: Path, records_dir: Path | None, echo: bool, resumable: bool
) -> tuple[dict, float]:
    """The launches of one row's run, relaunched (resumable) after a failure; its record."""
    (run_dir / "result.json").unlink(missing_ok=True)  # only this run's record counts
    job = run_folder.write_job(cfg, run_dir)
    world = cfg.parallelism.world_size
    cmd = modes.PROXY.command(world, [job])
    (run_dir / "command.txt").write_text(shlex.join(cmd) + "\n")
    env = modes.PROXY.env(world)
    result = run_dir / "result.json"
    t0 = time.perf_counter()
    for attempt in range(1, (RESUME_ATTEMPTS if resumable else 1) + 1):
        if echo:
            click.echo(
                f"== {recipe.id} · proxy · world {world} · {run_dir}" + (f" · attempt {attempt}" if attempt > 1 else "")
            )
        log = run_dir / f"train{'' if attempt == 1 else f'.{attempt}'}.log"
        rc = launcher.run_logged(cmd, env, log, echo)
        if rc == 0 and result.is_file():
            break
        if echo and resumable:
            click.echo(
                f"[convergence] {recipe.id}: attempt {attempt} failed (exit {rc}); resuming from the latest checkpoint",
                err=True,
            )
    wall = time.perf_counter() - t0
    if rc != 0 or not result.is_file():
        raise RuntimeError(f"{recipe.id}: trainer failed (exit {rc}); log {log}:\n{launcher.log_tail(log, 40)}")
    record = json.loads(result.read_text())
    if record.get("start_step"):
        record = _stitch(run_dir, record, attempt)
        atomic_write_json(result, record)
    _file(result, records_dir, recipe)
    return record, wall


def _file(result: Path, records_dir: Path | None, recipe: Recipe) -> None:
    """Into the records, unless a run that is not the row (e.g. --steps) would replace a
    conforming record in results/records/ (recipes/report/compliance.py)."""
    _, note = file_record(result, records_dir, "proxy", recipe.fname)
    if note:
        click.echo(f"note: {recipe.id}: {note}", err=True)


def golden_payload(records: dict[str, dict]) -> dict:
    base = records[control().id]
    return {
        "what": "per-step training losses of the loss-convergence proxies (run-recipe convergence)",
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "versions": base.get("versions"),
        "hardware": base.get("hardware"),
        "prefix_steps": PREFIX_STEPS,
        "prefix_tolerance": PREFIX_TOLERANCE,
        "tolerance": TOLERANCE,
        "rows": {
            rid: {
                "losses": rec["losses"],
                "world_size": rec["world_size"],
                "layout": record_label(rec),
                "toggles_applied": rec.get("toggles_applied"),
                "toggles_skipped": rec.get("toggles_skipped"),
                "config": rec.get("config"),
            }
            for rid, rec in records.items()
        },
    }


def golden_path(results_dir: Path | None = None) -> Path:
    return (results_dir or paths.results_root()) / "golden" / "loss_convergence.json"


def run_rows(chosen: list[Recipe], overrides: list[str], runs_root: Path, records_root: Path) -> None:
    """Each row's resumable run in runs_root/<id__>, every folder checked before the first runs;
    SIGINT / SIGTERM stop the launch and say how to resume (exit 130 / 143), as `run` does."""
    for r in chosen:
        try:
            other = other_run_in(runs_root / r.fname, row_config(r, overrides, resumable=True))
        except ConfigError as e:
            refuse(f"config error: {r.id}: {e}")
        if other:
            refuse(f"error: {r.id}: {runs_root / r.fname} holds another run ({other}): use another --out, or move it")
    try:
        with stop_on_signals():
            for r in chosen:
                _, wall = run_row(r, overrides, runs_root / r.fname, records_root, resumable=True)
                click.echo(f"[convergence] {r.id}: {wall:.0f} s")
    except (RuntimeError, ValueError, ConfigError) as e:
        click.echo(f"FAILED: {e}", err=True)
        sys.exit(1)
    except Stopped as e:
        again = shlex.join(["run-recipe", *sys.argv[1:]]) if sys.argv[1:2] == ["convergence"] else "the same command"
        click.echo(f"\nstopped by {e}: the rows resume from their checkpoints in {runs_root} with: {again}", err=True)
        sys.exit(e.exit_code)


# ------------------------------------------------------------------------------------ command
@click.command("convergence")
@click.option(
    "--steps",
    type=click.IntRange(min=PREFIX_STEPS),
    default=None,
    help="Steps per run (default: the rows' 500). Warmup keeps the rows' 1:5 ratio.",
)
@click.option(
    "--only",
    "only",
    multiple=True,
    metavar="ID",
    help="Run only these rows (ids or their last part); the others' records are reused.",
)
@options.records_dir_option("Where records go and are read (default: results/records, or OUT/records with --out).")
@options.out_dir_option(
    "Where the loss-convergence table, curves and golden file go, and the run folders (OUT/runs/<id__>); "
    "default: results/ (run folders in runs/convergence/)."
)
@click.option(
    "--golden/--no-golden",
    default=None,
    help="Rewrite OUT/golden/loss_convergence.json (default: only for full-length runs).",
)
def convergence(steps, only, records_dir, out_dir, golden):
    """Run the four loss-convergence rows as proxies, then plot and check them against 1D."""
    out = Path(out_dir) if out_dir else paths.results_root()
    records_root = Path(records_dir) if records_dir else (out / "records" if out_dir else paths.default_records_dir())
    check_writable("--out", out)
    check_writable("--records-dir", records_root)
    chosen = rows()
    if only:
        wanted = set(only)
        chosen = [r for r in chosen if r.id in wanted or column(r.id) in wanted]
        if not chosen:
            click.echo(f"error: --only matches none of: {', '.join(r.id for r in rows())}", err=True)
            sys.exit(2)
    full = control().job_config("proxy").training.steps
    steps = steps or full
    overrides = [f"training.steps={steps}", f"lr_scheduler.warmup_steps={warmup_for(steps)}"]
    runs_root = out / "runs" if out_dir else paths.default_runs_dir() / "convergence"
    run_rows(chosen, overrides, runs_root, records_root)
    records = {
        rid: rec
        for (rid, mode), rec in table_data.load_records(records_root).items()
        if mode == "proxy" and rid in {r.id for r in rows()}
    }
    for path in results.write_table(records_root, out, "loss_convergence"):  # its own files only
        click.echo(str(path))
    checked = check(records)
    for res in checked:
        click.echo(
            f"[convergence] {res['column']}: {res['status']}"
            + (
                f" (trailing mean |Δ| {res['mean_abs_diff_smoothed']:.4f} vs tolerance {res['tolerance']:g})"
                if res.get("mean_abs_diff_smoothed") is not None
                else ""
            )
        )
    all_full = len(records) == len(rows()) and all(len(rec["losses"]) == full for rec in records.values())
    if golden or (golden is None and all_full and steps == full):
        if not all_full:
            click.echo("error: --golden needs full-length records of every row", err=True)
            sys.exit(2)
        path = atomic_write_json(golden_path(out), golden_payload(records), indent=1)
        click.echo(str(path))
    if any(res.get("passed") is False for res in checked):
        sys.exit(1)
