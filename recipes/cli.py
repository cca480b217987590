"""`run-recipe`: list, show, run the paper's recipe rows, and regenerate the results tables.

Exit codes: 0 ok; 1 a launched run failed; 2 a bad id, option or configuration (nothing was
spawned); 3 the mode cannot run on this machine or in this build (nothing was spawned).

Subcommands of other modules (the studies in recipes/studies/, the layout advisor): one line
in EXTENSIONS below each; the module is imported only when its command runs (the studies import
torch, and `run-recipe list` / `--help` must stay fast). `main.add_command(cmd)` works too for
code that imports this module.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import json
import shlex
import sys
from pathlib import Path

import click
import tomllib
from tabulate import tabulate

from core import run_folder
from core.config import ConfigError, JobConfig, field_docs, flatten_keys
from core.validate import key_choices
from recipes import hardware_check, launcher, modes, options, output, paths, registry
from recipes.report.readme import recipe_table
from recipes.schema import MODES, TABLES, RecipeError

# name -> ("module:attribute" of a click command, imported lazily; its line in `--help`).
EXTENSIONS: dict[str, tuple[str, str]] = {
    "bench": ("recipes.studies.bench:bench", "Trainer overhead, proxy MFU, FSDP memory per rank (+ the two below)."),
    "benchmark-report": (
        "recipes.report.benchmarks:benchmark_report",
        "results/benchmarks/<date>-<cpu>.md from the measurements already written, and its index.",
    ),
    "checkpoint-bench": (
        "recipes.studies.checkpoint_bench:checkpoint_bench",
        "Checkpoint overhead: sync vs async DCP save.",
    ),
    "convergence": (
        "recipes.studies.convergence:convergence",
        "The four loss-convergence rows as proxies, plotted and checked vs 1D.",
    ),
    "check": (
        "recipes.report.check:check_cmd",
        "Whether each record is a conforming run of its row, and every reason why not.",
    ),
    "cp-memory": ("recipes.studies.cp_memory:cp_memory", "Activation memory per rank at CP 1, 2, 4."),
    "dry-run-table": (
        "recipes.report.dryrun_table:main",
        "results/dry_run.{csv,md} from the dry-run records (--all, --predict, --calibrate).",
    ),
    "gpu-spec": (
        "recipes.gpu_spec.command:gpu_spec",
        "Measure the device present (GEMMs, SDPA, bandwidth, collectives) into a GPU spec for --gpu FILE.",
    ),
    "parity": ("recipes.studies.parity:parity", "Loss parity of N-D layouts against the single-process run."),
    "preflight": (
        "recipes.studies.preflight:preflight",
        "First command on a new node: every feature the rows need, a verdict each, 1D parity.",
    ),
    "peer-bench": ("recipes.peer_bench.command:peer_bench", "Tokens/s beside torchtitan 0.3.0 on this CPU."),
    "plan": ("recipes.plan.layouts:plan", "Propose FSDP/TP/PP/CP degrees, checked by the dry-run memory estimate."),
    "toggles-bench": (
        "recipes.studies.toggles_bench:toggles_bench",
        "AC, regional compile and Float8 on the CPU proxy.",
    ),
}

MARKDOWN_HELP = (
    "A markdown table with each row's command, modes and results link (the README's recipe table; machine independent)."
)
SKIP_BAD_HELP = (
    "Leave out records that do not parse or hold a field of the wrong type (the tables say which); "
    "without it such a record stops the command before any table is written."
)
EXIT_FAILED, EXIT_CONFIG, EXIT_CANNOT = modes.EXIT_FAILED, modes.EXIT_CONFIG, modes.EXIT_CANNOT
DISTRIBUTION = "titan-recipes"  # pyproject's [project] name: `run-recipe --version` prints its version


class RecipeGroup(click.Group):
    """A click group that also serves the lazily imported EXTENSIONS commands."""

    def list_commands(self, ctx):
        present = {
            name
            for name, (target, _) in EXTENSIONS.items()
            if importlib.util.find_spec(target.split(":")[0]) is not None
        }
        return sorted(set(super().list_commands(ctx)) | present)

    def get_command(self, ctx, name):
        cmd = super().get_command(ctx, name)
        if cmd is None and name in EXTENSIONS:
            module, attr = EXTENSIONS[name][0].split(":")
            cmd = getattr(importlib.import_module(module), attr)
        return cmd

    def format_commands(self, ctx, formatter):
        """`--help` lists the extensions by their stored line, without importing them; each
        command's line is its docstring's first sentence, whole (click cuts it at 45 characters)."""
        rows = []
        for name in self.list_commands(ctx):
            if name in self.commands or name not in EXTENSIONS:
                rows.append((name, self.get_command(ctx, name).get_short_help_str(limit=sys.maxsize)))
            else:
                rows.append((name, EXTENSIONS[name][1]))
        if rows:
            with formatter.section("Commands"):
                formatter.write_dl(rows)


def _fail(message: str, code: int) -> None:
    click.echo(message, err=True)
    sys.exit(code)


def _select(ids, table) -> list:
    try:
        chosen = registry.select(list(ids), table)
    except RecipeError as e:
        _fail(f"error: {e}", EXIT_CONFIG)
    if not chosen:
        _fail("error: name at least one recipe id (or --table); see `run-recipe list --ids`", EXIT_CONFIG)
    return chosen


def project_version() -> str:
    """The installed distribution's version, else (a checkout run without installing) pyproject's."""
    try:
        return importlib.metadata.version(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return tomllib.loads((paths.PACKAGE_ROOT / "pyproject.toml").read_text())["project"]["version"]


@click.group(cls=RecipeGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(project_version(), "--version", prog_name="run-recipe", message="%(prog)s %(version)s")
def main():
    """Titan Recipes: the TorchTitan paper's tables as runnable recipe rows.

    Modes: real (the paper's exact configuration on GPUs), proxy (the same layout scaled to a
    CPU), dry-run (true-scale memory estimate without GPUs).
    """


# --------------------------------------------------------------------------------- list
@main.command("list")
@click.option("--ids", is_flag=True, help="Only the ids, one per line.")
@click.option("--table", type=click.Choice(TABLES), help="Only the rows of one table.")
@click.option("--markdown", is_flag=True, help=MARKDOWN_HELP)
def list_cmd(ids, table, markdown):
    """The recipe rows: id, table, row, paper GPUs, proxy world size, modes runnable here."""
    recipes = registry.by_table(table) if table else registry.all_recipes()
    if markdown:
        click.echo(recipe_table(recipes))
        return
    if ids:
        for r in recipes:
            click.echo(r.id)
        return
    dry = launcher.dry_run_available()
    gpus = _visible_gpus()
    rows = []
    for r in recipes:
        modes = []
        nodes = r.nnodes()
        if nodes > 1:
            modes.append(f"real ({nodes} nodes: --slurm)")
        elif gpus >= r.gpus:
            modes.append("real")
        modes.append("proxy")
        if dry:
            modes.append("dry-run")
        rows.append([r.id, r.table, r.row, r.gpus, r.world("proxy"), ", ".join(modes)])
    click.echo(tabulate(rows, headers=["id", "table", "row", "GPUs", "proxy world", "modes here"]))
    if not dry:
        click.echo("\n(dry-run is not available in this build: core.dryrun is missing)")


def _visible_gpus() -> int:
    try:
        import torch  # here: the CLI must not pay torch's import unless it looks at the GPUs

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # noqa: BLE001 - listing must work whatever the torch build
        return 0


# --------------------------------------------------------------------------------- show
@main.command("keys")
@click.argument("pattern", required=False, default="")
def keys_cmd(pattern):
    """Every config key `--set` accepts: its default, allowed values and meaning.

    The allowed values where they are a fixed set: the model flavors and the `Literal` types of
    core/config.py. PATTERN keeps the keys that contain it."""
    defaults = flatten_keys(JobConfig().to_dict())
    choices = key_choices()
    rows = [
        [k, _short(defaults.get(k)), ", ".join(choices.get(k, ())), doc]
        for k, doc in field_docs().items()
        if pattern in k and k not in registry.CLI_OWNED_KEYS  # set by --mode, the id, --out
    ]
    if not rows:
        _fail(f"error: no config key contains {pattern!r}; see `run-recipe keys`", EXIT_CONFIG)
    headers = ["key", "default", "choices", "meaning"]
    click.echo(tabulate(rows, headers=headers, disable_numparse=True, maxcolwidths=[None, 24, 22, 64]))


@main.command("show")
@click.argument("recipe_id")
@click.option("--json", "as_json", is_flag=True, help="Everything as JSON, full resolved configs.")
@options.overrides_option(
    "Preview the configs with this override (as `run --set`); repeatable. Keys: `run-recipe keys`."
)
def show_cmd(recipe_id, as_json, overrides):
    """A row: resolved paper and proxy configs, reference figures, what each mode needs."""
    try:
        r = registry.get(recipe_id)
        cfgs = {m: registry.resolve_config(r, m, overrides) for m in ("real", "proxy")}
    except (RecipeError, ConfigError) as e:
        _fail(f"error: {e}", EXIT_CONFIG)
    hard, advisory = hardware_check.real_requirements(r, cfgs["real"])
    if as_json:
        click.echo(json.dumps(_show_record(r, cfgs, hard, advisory), indent=2))
        return
    click.echo(f"{r.id} — {r.title}")
    click.echo(f"{r.table}, row {r.order}: {r.row}   techniques: {', '.join(r.techniques)}")
    if r.baseline:
        click.echo(f"baseline: {r.baseline}")
    click.echo(f"file: {r.source}")
    if r.notes:
        click.echo(f"notes: {r.notes}")
    click.echo(
        f"\npaper: {r.gpus} GPUs = {r.nnodes()} node(s) x {min(r.gpus, r.gpus_per_node)}"
        f"    proxy: world {cfgs['proxy'].parallelism.world_size}\n"
    )
    click.echo("configuration (keys that differ from the JobConfig defaults)")
    click.echo(
        tabulate(
            _config_rows(cfgs),
            headers=["key", "paper (real, dry-run)", "proxy", "meaning"],
            disable_numparse=True,
            maxcolwidths=[None, None, None, 60],
        )
    )
    click.echo("\nreference figures")
    click.echo(
        tabulate(
            [[k, v] for k, v in r.reference.items()] or [["(none)", ""]],
            headers=["key", "value"],
            disable_numparse=True,
        )
    )
    click.echo("\nmodes")
    for line in _mode_lines(r, cfgs, hard, advisory):
        click.echo(line)


def _show_record(r, cfgs: dict[str, JobConfig], hard: list[str], advisory: list[str]) -> dict:
    """`show --json`: the row, both resolved configs, its figures and what each mode needs."""
    return {
        "id": r.id,
        "title": r.title,
        "table": r.table,
        "row": r.row,
        "order": r.order,
        "techniques": list(r.techniques),
        "baseline": r.baseline,
        "source": r.source,
        "paper": {
            "gpus": r.gpus,
            "gpus_per_node": r.gpus_per_node,
            "nodes": r.nnodes(),
            "config": cfgs["real"].to_dict(),
        },
        "proxy": {"world": cfgs["proxy"].parallelism.world_size, "config": cfgs["proxy"].to_dict()},
        "reference": r.reference,
        "requires": {
            "real": hard,
            "advisory": advisory,
            "proxy": list(r.requires.get("proxy", ["cpu"])),
            "dry-run": ["core.dryrun"],
        },
    }


def _config_rows(cfgs: dict[str, JobConfig]) -> list[list[str]]:
    """Keys whose paper or proxy value differs from the JobConfig default, then the asset paths."""
    defaults = flatten_keys(JobConfig().to_dict())
    paper, proxy = flatten_keys(cfgs["real"].to_dict()), flatten_keys(cfgs["proxy"].to_dict())
    skip = ("job.", "tokenizer.path", "data.path")
    docs = field_docs()
    rows = [
        [k, _short(paper[k]), _short(proxy[k]), docs.get(k, "")]
        for k in paper
        if (paper[k] != defaults.get(k) or proxy[k] != defaults.get(k)) and not k.startswith(skip)
    ]
    return rows + [
        [k, paths.relative(paper[k]), paths.relative(proxy[k]), docs.get(k, "")]
        for k in ("tokenizer.path", "data.path")
    ]


def _mode_lines(r, cfgs: dict[str, JobConfig], hard: list[str], advisory: list[str]) -> list[str]:
    """What each mode needs, and whether this machine has it."""
    report = hardware_check.check_node(r, cfgs["real"]) if r.nnodes() == 1 else None
    here = (
        "runs here"
        if report and report.ok
        else f"not here: {'; '.join(report.missing)}"
        if report
        else f"{r.nnodes()} nodes: prints the torchrun command, or --slurm writes an sbatch script"
    )
    dry = "available" if launcher.dry_run_available() else "not available in this build"
    return [
        f"  real:    needs {', '.join(hard)}"
        + (f"; advisory {', '.join(advisory)}" if advisory else "")
        + f"  [{here}]",
        f"  proxy:   needs {', '.join(r.requires.get('proxy', ['cpu']))}, world "
        f"{cfgs['proxy'].parallelism.world_size} processes, offline assets (python -m core.data.assets --all)",
        f"  dry-run: needs core.dryrun  [{dry}]",
    ]


def _short(v) -> str:
    s = json.dumps(v) if isinstance(v, (list, bool)) else str(v)
    return s if len(s) <= 60 else s[:57] + "..."


# ---------------------------------------------------------------------------------- run
@main.command("run")
@click.argument("ids", nargs=-1, callback=options.one_line)
@click.option("--table", type=click.Choice(TABLES), help="Run every row of a table (with any ids).")
@click.option("--mode", type=click.Choice(MODES), default="proxy", show_default=True)
@options.overrides_option("Override a config key (TOML literal), applied after the recipe; repeatable.")
@options.out_dir_option(
    "Run directory (DIR/<id__> when several rows run). Default: runs/<id__>/<timestamp>. With --out the "
    "record stays in DIR only, unless --records-dir is given too.",
    name="out",
)
@options.records_dir_option(
    "Where records are copied as <mode>/<id__>.json (default: results/records, or none with --out)."
)
@click.option("--slurm", is_flag=True, help="real mode: write an sbatch script to the run dir instead of running.")
@click.option(
    "--sbatch",
    "sbatch_opts",
    multiple=True,
    metavar="OPTION",
    help="Extra #SBATCH option for --slurm, e.g. --sbatch partition=h100; repeatable.",
    callback=options.one_line,
)
@click.option(
    "--max-restarts",
    type=click.IntRange(min=0),
    default=0,
    show_default=True,
    help="torchrun restarts the group this often after a rank dies; the run resumes "
    "from its latest complete checkpoint (set checkpoint.enabled=true).",
)
@options.text_option(
    "--gpu",
    "NAME",
    "dry-run: the GPU system of the throughput prediction (core/dryrun/hardware/NAME.toml, or a spec FILE; "
    "default: the paper's h100_96gb_hbm2e_500w).",
)
@options.text_option(
    "--software",
    "KEY=VALUE,...",
    "dry-run: the software the prediction speaks for, e.g. date=2025-03,torch=2.7.0 (a torchtitan stack; "
    "default: this trainer at the pinned versions). Keys: date, trainer, torch, torchao, torchtitan, cuda, "
    "rocm, cudnn, nccl.",
)
@click.option("--verbose", is_flag=True, help="Also echo the launch command and the ranks' failure reports.")
@click.option(
    "--record-deviating",
    is_flag=True,
    help="File the record in results/records even where the run is not the row as published (--set) and "
    "a conforming record is there (default: it stays in the run folder; see `run-recipe check`).",
)
@click.option(
    "--skip-memory-check",
    is_flag=True,
    help="proxy: run even where the dry-run's memory accounting says the ranks do not fit in this host's memory.",
)
def run_cmd(
    ids,
    table,
    mode,
    overrides,
    out,
    records_dir,
    slurm,
    sbatch_opts,
    max_restarts,
    gpu,
    software,
    verbose,
    record_deviating,
    skip_memory_check,
):
    """Run recipe rows in a mode: validate first, then launch torchrun (or print / write the
    multi-node launch)."""
    recipes = _select(ids, table)
    options = modes.RunOptions(
        out=Path(out) if out else None,
        records=Path(records_dir) if records_dir else (None if out else paths.default_records_dir()),
        several=len(recipes) > 1,
        max_restarts=max_restarts,
        slurm=slurm,
        sbatch_opts=tuple(sbatch_opts),
        gpu=gpu,
        software=software,
        verbose=verbose,
        record_deviating=record_deviating,
        skip_memory_check=skip_memory_check,
    )
    runner = modes.MODES[mode](options)
    try:
        with output.stop_on_signals():
            failed = modes.run_rows(runner, recipes, overrides)
    except modes.RowRefused as e:
        _fail(str(e), e.code)
    except output.Stopped as e:
        _fail(_stopped_line(e, mode, overrides), e.exit_code)
    if failed:
        lines = [f"{len(failed)} of {len(recipes)} runs failed:"]
        lines += [f"  {rid}: {runner.failures[rid][0]}  [log: {runner.failures[rid][1]}]" for rid in failed]
        _fail("\n".join(lines), EXIT_FAILED)


def _stopped_line(e: output.Stopped, mode: str, overrides) -> str:
    """One line: what stopped, the last complete checkpoint, the command that resumes."""
    row = next((r for r in e.rows if not (r.run_dir / "result.json").is_file()), e.rows[0] if e.rows else None)
    if row is None:
        return f"\nstopped by {e}: nothing was running"
    steps = run_folder.checkpoint_steps(row.cfg, row.run_dir)
    ckpt = f"last complete checkpoint step {steps[-1]}" if steps else "no complete checkpoint (it starts again)"
    sets = "".join(f" --set {shlex.quote(o)}" for o in overrides)
    return (  # a new line first: a progress bar may have the cursor
        f"\nstopped by {e}: {row.recipe.id} in {row.run_dir}; {ckpt}; resume with: "
        f"run-recipe run {row.recipe.id} --mode {mode} --out {shlex.quote(str(row.run_dir))}{sets}"
    )


# ------------------------------------------------------------------------------ results
@main.command("results")
@options.records_dir_option("Records to read (default: results/records).")
@options.out_dir_option("Where the tables go (default: results/).")
@click.option("--skip-bad-records", is_flag=True, help=SKIP_BAD_HELP)
@click.option(
    "--include-deviating",
    is_flag=True,
    help="Also show records that are not a conforming run of their row (`run-recipe check`), each row "
    "marked ≠ with its reasons; without it they are left out and listed.",
)
def results_cmd(records_dir, out_dir, skip_bad_records, include_deviating):
    """Regenerate results/<table>.md + .csv and results/README.md from the conforming records only."""
    from recipes.report import results  # pandas + matplotlib: only for the command that writes tables
    from recipes.report.table_data import NoRecordsError, RecordError

    records = Path(records_dir) if records_dir else paths.default_records_dir()
    out = Path(out_dir) if out_dir else paths.project_root() / "results"
    options.check_writable("--out", out)
    try:
        written = results.write_results(records, out, skip_bad_records, include_deviating)
    except RecordError as e:
        _fail(f"error: {e}; no table was written (fix or remove it, or add --skip-bad-records)", EXIT_CONFIG)
    except NoRecordsError as e:
        _fail(f"error: --records-dir {e}; no table was written", EXIT_CONFIG)
    except OSError as e:  # a disk that filled or went read-only since the check
        _fail(f"error: --out {out}: cannot write {e.filename}: {e.strerror or e}", EXIT_FAILED)
    for path in written:
        click.echo(str(path))


if __name__ == "__main__":
    main()
