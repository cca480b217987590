"""How a row runs in each mode: one object per mode resolves a row's config, checks what can be
checked before anything is spawned, then launches, prints or writes the run and files its record.
`run-recipe run` picks the object once (`MODES[name](options)`); each reads alone.

- ProxyMode: the row's proxy overlay on this machine's CPUs (gloo). Rows of one world size share
  one launch whose ranks are forked from a process that imported the trainer once.
- RealMode: the paper's configuration on CUDA GPUs: this node through torchrun, more nodes through
  the command it prints or the sbatch script it writes (--slurm).
- DryRunMode: the paper's configuration at true scale, traced on a fake process group in this
  process (core.dryrun): memory per rank and the predicted throughput.

The shared mechanics: launching (torchrun commands, the environment, the dry run) is
recipes/launcher.py; the run folder (made, owned, checked for a resume, its job and record) is
core/run_folder.py.
"""

from __future__ import annotations

import contextlib
import json
import shlex
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import click

from core import run_folder
from core.checkpoint.folder import CheckpointError
from core.config import ConfigError, JobConfig
from core.fileio import check_writable_folder
from core.validate import check_assets, validate
from recipes import hardware_check, launcher, multinode, paths, registry
from recipes.cluster_env import node_local_reason, real_env_defaults
from recipes.output import Stopped, failure_cause, stream
from recipes.schema import Recipe

EXIT_FAILED, EXIT_CONFIG, EXIT_CANNOT = 1, 2, 3


class RowRefused(Exception):
    """A row that cannot run as asked, found before anything was spawned; `code` is the CLI's
    exit code (2: a bad option or configuration, 3: not on this machine or build)."""

    def __init__(self, message: str, code: int = EXIT_CONFIG):
        super().__init__(message)
        self.code = code


@dataclass
class RunOptions:
    """What `run-recipe run` was asked besides the rows and the mode."""

    out: Path | None = None  # --out: the run folder (DIR/<id__> when several rows run)
    records: Path | None = None  # records are copied to <records>/<mode>/<id__>.json
    several: bool = False
    max_restarts: int = 0
    slurm: bool = False
    sbatch_opts: tuple[str, ...] = ()
    gpu: str | None = None
    software: str | None = None  # dry-run: the software stack the prediction speaks for
    verbose: bool = False  # the launch command and the ranks' failure reports on the terminal too
    record_deviating: bool = False  # file a record that is not the row's over a conforming one
    skip_memory_check: bool = False  # proxy: run even where the accounting says the host is too small


@dataclass
class Row:
    """One recipe row on its way to a run: its resolved config, then its folder and job file."""

    recipe: Recipe
    cfg: JobConfig
    run_dir: Path | None = None
    job: Path | None = None  # run_dir/job.json once written
    notes: list[str] = field(default_factory=list)

    @property
    def world(self) -> int:
        return self.cfg.parallelism.world_size

    @property
    def nnodes(self) -> int:
        return self.recipe.nnodes(self.world)


class RowMode:
    """What every mode does alike; the subclasses say how they differ."""

    name: ClassVar[str]  # the recipe overlay it runs, and the records' sub-folder
    check_files: ClassVar[bool] = False  # validate asset files before launch
    forks_ranks: ClassVar[bool] = False  # ranks forked from one process (recipes/forked_run.py)

    def __init__(self, options: RunOptions | None = None):
        self.options = options or RunOptions()
        self.failures: dict[str, tuple[str, Path]] = {}  # row id -> (the rank's own error line, log)

    # --------------------------------------------------------------------- before anything runs
    def check_options(self) -> None:
        if self.options.gpu is not None or self.options.software is not None:
            raise RowRefused("error: --gpu and --software are for --mode dry-run")
        if self.options.slurm:
            raise RowRefused("error: --slurm is for --mode real")

    def resolve(self, recipe: Recipe, overrides: list[str] | tuple[str, ...] = ()) -> JobConfig:
        """The row's overlay for this mode <- `--set` overrides, validated (ConfigError names the key)."""
        return registry.resolve_config(recipe, self.name, overrides, check_files=self.check_files)

    def plan(self, recipe: Recipe, overrides: list[str] | tuple[str, ...]) -> Row:
        """A row resolved and checked for this mode (RowRefused says why not)."""
        try:
            row = Row(recipe, self.resolve(recipe, overrides))
        except ConfigError as e:
            raise RowRefused(f"config error: {recipe.id}: {e}") from None
        self.check_row(row)
        return row

    def check_row(self, row: Row) -> None:
        """Checks of this mode that need no process (RowRefused)."""

    # -------------------------------------------------------------------------------- running
    def env(self, world: int, max_restarts: int = 0, **set_vars: str) -> dict[str, str]:
        return launcher.base_env(max_restarts=max_restarts, **set_vars)

    def command(self, world: int, jobs: list[Path], max_restarts: int = 0) -> list[str]:
        """torchrun of core.train on one node; several jobs run one after another in one group."""
        target = launcher.trainer_target(jobs[0])
        for path in jobs[1:]:
            target += ["--config", str(path)]
        return launcher.torchrun_command(world, target, max_restarts=max_restarts, forked=self.forks_ranks)

    def shares_launch(self) -> bool:
        """Whether rows of one world size may run one after another in one launch."""
        return False

    def run_elsewhere(self, row: Row) -> bool:
        """Run, print or write a row that does not launch on this node; False for local rows."""
        return False

    def run(self, rows: list[Row], locks: contextlib.ExitStack) -> list[str]:
        """Each row's folder owned and its job written, then run; returns the ids that failed."""
        local = []
        for row in rows:
            claim_run_dir(locks, row, self.options)
            try:
                row.job = run_folder.write_job(row.cfg, row.run_dir)
            except OSError as e:  # a disk that filled since: nothing was spawned for this row
                raise RowRefused(f"error: {row.recipe.id}: cannot write {e.filename}: {e.strerror or e}") from None
            if not self.run_elsewhere(row):
                local.append(row)
        return run_local_rows(local, self) if local else []

    def record(self, result: Path, recipe: Recipe, records_dir: Path | None) -> Path | None:
        """The run's record copied to <records_dir>/<mode>/<id__>.json (none without a folder);
        one that is not the row as published never replaces a conforming one in results/records/
        (recipes/report/compliance.py) unless asked (--record-deviating)."""
        from recipes.report.compliance import file_record  # here: `run`'s checks never need it

        dest, note = file_record(result, records_dir, self.name, recipe.fname, self.options.record_deviating)
        if note:
            click.echo(f"note: {recipe.id}: {note}", err=True)
        return dest

    def banner(self, row: Row) -> str:
        span = f" ({row.nnodes} nodes x {row.recipe.gpus_per_node})" if row.nnodes > 1 else ""
        return f"== {row.recipe.id} · {self.name} · world {row.world}{span} · {row.run_dir}"


class ProxyMode(RowMode):
    name = "proxy"
    check_files = True
    forks_ranks = True

    def env(self, world: int, max_restarts: int = 0, **set_vars: str) -> dict[str, str]:
        env = {}
        if world > 1:
            env["OMP_NUM_THREADS"] = "1"  # the ranks share the CPU cores ...
            # ... but one rank compiles each graph while the others wait for it (compile_cache), so
            # its C++ kernels build on every core (TP 2 x DP 2 cold first step: 27.4 s -> 23.4 s)
            env["TORCHINDUCTOR_COMPILE_THREADS"] = str(launcher.usable_cpus())
        # proxies run on CPU + gloo, whatever the node has
        return launcher.base_env(defaults=env, max_restarts=max_restarts, **{"CUDA_VISIBLE_DEVICES": "", **set_vars})

    def shares_launch(self) -> bool:
        return not self.options.max_restarts  # a restart resumes one job

    def check_row(self, row: Row) -> None:
        """A proxy whose ranks would not fit in this host's memory is refused before they take it
        (an 8B proxy's ranks would allocate until the OOM killer ends them, or someone else)."""
        if self.options.skip_memory_check:
            return
        import psutil

        from core.dryrun.memory import proxy_host_gib  # the dry-run's accounting (no torch)

        per_rank, need = proxy_host_gib(row.cfg)
        have = psutil.virtual_memory().available / 2**30
        if need > have:
            raise RowRefused(
                f"error: {row.recipe.id}: proxy mode needs about {need:,.1f} GiB ({row.world} ranks x "
                f"{per_rank:,.1f} GiB: model.flavor={row.cfg.model.flavor}, by the dry-run's memory accounting) "
                f"and this machine has {have:,.1f} GiB available; use a smaller model.flavor (or fewer layers, "
                "a shorter training.seq_len), or --skip-memory-check to run anyway"
            )


class RealMode(RowMode):
    name = "real"

    def check_options(self) -> None:
        if self.options.gpu is not None or self.options.software is not None:
            raise RowRefused("error: --gpu and --software are for --mode dry-run")

    def check_row(self, row: Row) -> None:
        r = row.recipe
        try:  # the tokenizer (and a project corpus) the ranks will read, wherever they run
            check_assets(row.cfg)
        except ConfigError as e:
            raise RowRefused(f"config error: {r.id}: {e}") from None
        if row.nnodes > 1 and row.world % r.gpus_per_node:
            raise RowRefused(
                f"config error: {r.id}: parallelism: world size {row.world} spans {row.nnodes} nodes "
                f"but is not a multiple of {r.gpus_per_node} GPUs per node"
            )
        if row.nnodes > 1 or self.options.slurm:
            where = node_local_reason(Path(self.options.out or paths.default_runs_dir()))
            if where:
                click.echo(
                    f"warning: {r.id}: --out: {where}: every node must read job.json and write there; "
                    "use a folder on the cluster's shared file system",
                    err=True,
                )
            if row.cfg.data.dataset == "c4_offline" and not Path(row.cfg.data.path).exists():
                click.echo(  # a user's local C4 copy may live on the nodes only (node-local disks)
                    f"warning: {r.id}: data.path: {row.cfg.data.path} is not on this host; every node must read it",
                    err=True,
                )
            return
        report = hardware_check.check_node(r, row.cfg)
        if not report.ok:
            raise RowRefused(
                f"error: {r.id}: real mode cannot run on this machine:\n"
                + "".join(f"  - missing {m}\n" for m in report.missing)
                + "try --mode proxy (the same layout on CPU), --mode dry-run (true-scale "
                "memory estimate), or --slurm (an sbatch script for a GPU cluster)",
                EXIT_CANNOT,
            )
        for note in report.notes:
            click.echo(f"note: {r.id}: {note}", err=True)
        try:
            validate(row.cfg, check_files=True)
        except ConfigError as e:
            raise RowRefused(f"config error: {r.id}: {e}") from None

    def env(self, world: int, max_restarts: int = 0, **set_vars: str) -> dict[str, str]:
        # one list with the sbatch script's and the per-node command's: a node-local compile cache (the
        # checkout is often on a shared file system), the allocator's settings
        return launcher.base_env(defaults=real_env_defaults(), max_restarts=max_restarts, **set_vars)

    def run_elsewhere(self, row: Row) -> bool:
        if not (self.options.slurm or row.nnodes > 1):
            return False
        click.echo(self.banner(row))
        r, nproc = row.recipe, min(row.world, row.recipe.gpus_per_node)
        if self.options.slurm:
            script = row.run_dir / "sbatch.sh"
            text = multinode.sbatch_script(
                r,
                row.cfg,
                row.run_dir,
                row.nnodes,
                nproc,
                self.options.records,
                self.options.sbatch_opts,
                max_restarts=self.options.max_restarts,
            )
            script.write_text(text)
            script.chmod(0o755)
            click.echo(f"sbatch script: {script}\nsubmit with: sbatch {shlex.quote(str(script))}")
            return True
        where = "On every node, with HOST the first node's address:"
        click.echo(f"{r.id} needs {row.nnodes} nodes x {nproc} GPUs. {where}\n")
        command = multinode.multinode_command(
            row.nnodes, nproc, row.job, r.fname, max_restarts=self.options.max_restarts
        )
        click.echo("  " + command + "\n")
        click.echo("or let run-recipe write an sbatch script: add --slurm")
        return True


class DryRunMode(RowMode):
    name = "dry-run"

    def check_options(self) -> None:
        if self.options.slurm:
            raise RowRefused("error: --slurm is for --mode real")
        if self.options.gpu is not None:
            from core.dryrun.gpuspec import SpecError, load_spec

            try:
                load_spec(self.options.gpu)
            except SpecError as e:
                raise RowRefused(f"error: --gpu: {e}") from None
        if self.options.software is not None:
            from core.dryrun.software import parse

            try:
                parse(self.options.software)
            except ValueError as e:
                raise RowRefused(f"error: {e}") from None
        if not launcher.dry_run_available():
            raise RowRefused(
                "error: dry-run is not available in this build (core.dryrun is missing); use --mode proxy", EXIT_CANNOT
            )

    def resolve(self, recipe: Recipe, overrides: list[str] | tuple[str, ...] = ()) -> JobConfig:
        """--software's config defaults (torchtitan's AdamW before PR 881: foreach) <- `--set`."""
        from core.dryrun.software import parse

        defaults = parse(self.options.software).settings() if self.options.software is not None else []
        return registry.resolve_config(recipe, self.name, overrides, check_files=self.check_files, defaults=defaults)

    def run_elsewhere(self, row: Row) -> bool:
        click.echo(self.banner(row))
        from core.dryrun.gemm import NoGemmRate

        try:
            launcher.run_dry(row.cfg, row.run_dir, self.options.gpu, software=self.options.software)
        except launcher.CannotRunHere as e:
            raise RowRefused(f"error: {e}", EXIT_CANNOT) from None
        except NoGemmRate as e:  # a Float8 recipe the GPU spec has no measured rate for
            raise RowRefused(f"error: {row.recipe.id}: {e}") from None
        result = row.run_dir / "result.json"
        dest = self.record(result, row.recipe, self.options.records)
        for line in launcher.dry_run_summary(json.loads(result.read_text())):
            click.echo(f"  {line}")
        click.echo(f"record: {result}" + (f" -> {dest}" if dest else ""))
        return True


MODES: dict[str, type[RowMode]] = {m.name: m for m in (RealMode, ProxyMode, DryRunMode)}
PROXY = ProxyMode()  # for studies and tests that launch proxies themselves


# ------------------------------------------------------------------------------ local launches
def groups(rows: list[Row], shared: bool) -> list[list[Row]]:
    """Consecutive rows that can share a launch (when the mode allows it, `shared`): one world
    size and one [comm] (the process group's settings)."""
    out: list[list[Row]] = []
    for row in rows:
        last = out[-1][-1] if out else None
        if shared and last is not None and (last.world, last.cfg.comm) == (row.world, row.cfg.comm):
            out[-1].append(row)
        else:
            out.append([row])
    return out


def _launch(rows: list[Row], mode: RowMode) -> tuple[int, float]:
    cmd = mode.command(rows[0].world, [r.job for r in rows], mode.options.max_restarts)
    for r in rows:  # shell-quoted: a folder with a space or quote pastes back as one argument
        (r.run_dir / "command.txt").write_text(shlex.join(cmd) + "\n")
    if mode.options.verbose:
        click.echo("$ " + shlex.join(cmd))
    logs = {r.cfg.job.output_dir: r.run_dir / "train.log" for r in rows} if len(rows) > 1 else None
    started = time.time()
    env = mode.env(rows[0].world, max_restarts=mode.options.max_restarts)
    rc = stream(cmd, env, rows[0].run_dir / "train.log", job_logs=logs, verbose=mode.options.verbose)
    return rc, started


def run_local_rows(rows: list[Row], mode: RowMode) -> list[str]:
    """Run rows on this node, grouped where they can share a launch: proxy rows of one world
    size share one torchrun (core.train's multi-job launch), so start-up, imports and the
    rendezvous are paid once per group; each row keeps its run dir, `train.log`, `command.txt`
    and record. After a failed launch the row that failed is reported and the rows after it run
    again in a new launch. Returns the ids of the rows that failed."""
    failed = []
    pending = groups(rows, mode.shares_launch())
    while pending:
        group = pending.pop(0)
        for r in group:
            click.echo(mode.banner(r))
        if len(group) > 1:
            click.echo(f"-- these {len(group)} rows share one torchrun, one after another")
        try:
            rc, started = _launch(group, mode)
        except Stopped as e:
            e.rows = group
            raise
        for i, r in enumerate(group):
            result = r.run_dir / "result.json"
            fresh = result.is_file() and result.stat().st_mtime >= started  # not a previous run's record
            if fresh and (rc == 0 or i < len(group) - 1):  # a failed launch: its last row failed
                dest = mode.record(result, r.recipe, mode.options.records)
                from core.result import summary  # here: core.result imports torch, which `run`'s checks never need

                click.echo(f"{r.recipe.id}: {summary(json.loads(result.read_text()))}")
                click.echo(f"record: {result}" + (f" -> {dest}" if dest else ""))
                continue
            log = r.run_dir / "train.log"
            click.echo(f"FAILED: {r.recipe.id} (exit {rc}); log: {log}", err=True)
            mode.failures[r.recipe.id] = (failure_cause(log) or f"exit {rc}", log)
            failed.append(r.recipe.id)
            if group[i + 1 :]:  # the launch ended with this row: the rest get a launch of their own
                pending.insert(0, group[i + 1 :])
            break
    return failed


# -------------------------------------------------------------------------------- run folders
def claim_run_dir(locks: contextlib.ExitStack, row: Row, options: RunOptions) -> None:
    """Make the row's run folder (if not yet), own it until `locks` closes, and check the
    checkpoint it would resume from (RowRefused naming the holder, the key or the path)."""
    if row.run_dir is not None:
        return
    try:
        row.run_dir = run_folder.make(row.recipe.fname, options.out, options.several, paths.default_runs_dir())
        note = run_folder.claim(locks, row.cfg, row.run_dir)
        if note:
            click.echo(f"note: {row.recipe.id}: {note}", err=True)
    except (run_folder.RunDirBusy, CheckpointError) as e:
        raise RowRefused(f"error: {row.recipe.id}: {e}") from None
    except ConfigError as e:
        raise RowRefused(f"config error: {row.recipe.id}: {e}") from None
    except OSError as e:  # a read-only file system, no permission, a file in the way
        where = e.filename or options.out or "the run folder"
        raise RowRefused(f"error: {row.recipe.id}: cannot write the run folder {where}: {e.strerror or e}") from None


def claim_existing_run_dirs(locks: contextlib.ExitStack, rows: list[Row], options: RunOptions) -> None:
    """Folders named by --out that exist already may hold another run, or checkpoints to resume:
    owned and checked before any row runs."""
    if options.out is None:
        return
    for row in rows:
        if (Path(options.out) / (row.recipe.fname if options.several else "")).is_dir():
            claim_run_dir(locks, row, options)


def check_records_dir(options: RunOptions) -> None:
    """The records folder can be written: found before the runs, not after them (RowRefused)."""
    if options.records is None:
        return
    try:
        check_writable_folder(options.records)
    except OSError as e:
        where = f"--records-dir {options.records}"
        raise RowRefused(f"error: {where}: cannot write in {e.filename}: {e.strerror}") from None


def run_rows(mode: RowMode, recipes: list[Recipe], overrides: tuple[str, ...]) -> list[str]:
    """`run-recipe run`: every check for every row first, then each row runs; the ids that failed."""
    mode.check_options()
    check_records_dir(mode.options)
    rows = [mode.plan(r, overrides) for r in recipes]
    with contextlib.ExitStack() as locks:  # each run folder is owned until the command ends
        claim_existing_run_dirs(locks, rows, mode.options)
        return mode.run(rows, locks)


# ---------------------------------------------------------------------- programmatic launches
def launch_trainer(
    world: int,
    overrides: list[str],
    out_dir: str | Path,
    config: str | Path | None = None,
    mode: RowMode = PROXY,
    echo: bool = False,
    max_restarts: int = 0,
    env: dict[str, str] | None = None,
) -> dict:
    """Studies and tests: torchrun `world` ranks of core.train with `--section.key=value`
    overrides, output in out_dir; returns the record (result.json). `env`: variables set for the
    ranks over the mode's own. Raises RuntimeError with the log's tail when the run fails."""
    out_dir = Path(out_dir).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    target = launcher.trainer_target(config, [*overrides, f"--job.output_dir={out_dir}", f"--job.mode={mode.name}"])
    cmd = launcher.torchrun_command(world, target, max_restarts=max_restarts, forked=mode.forks_ranks)
    log = out_dir / "train.log"
    with run_folder.lock(out_dir):
        rc = launcher.run_logged(cmd, mode.env(world, max_restarts=max_restarts, **(env or {})), log, echo)
    result = out_dir / "result.json"
    if rc != 0 or not result.is_file():
        raise RuntimeError(f"trainer failed (exit {rc}) at world {world}; log {log}:\n{launcher.log_tail(log)}")
    return json.loads(result.read_text())
