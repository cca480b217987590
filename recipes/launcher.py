"""The mechanics every mode shares (recipes/modes.py says how each mode uses them): resolve and
validate a row's JobConfig, make and lock its run folder, build torchrun commands and the
launch environment, run a command into a log, copy a record. The machine check:
recipes/hardware_check.py; the multi-node command and the sbatch script: recipes/multinode.py.

Nothing here trains: every run is `python -m torch.distributed.run ... -m core.train --config
<run_dir>/job.json`, and the trainer writes `<run_dir>/result.json` (the record).
"""

from __future__ import annotations

import datetime
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

from core.checkpoint.folder import INFO, CheckpointError, complete_steps, read_info, resolve, resolve_source, start_step
from core.config import ConfigError, JobConfig, apply_dict, save_config
from core.fileio import atomic_copy, atomic_write_json
from core.models.args import model_args, model_shape
from core.overrides import parse_override
from core.validate import validate
from recipes.output import stream
from recipes.schema import Recipe

PACKAGE_ROOT = Path(__file__).resolve().parents[1]


def project_root() -> Path:
    """The source checkout holding the recipes (editable install), else the working directory."""
    return PACKAGE_ROOT if (PACKAGE_ROOT / "pyproject.toml").is_file() else Path.cwd()


def default_runs_dir() -> Path:
    return project_root() / "runs"


def results_root() -> Path:
    """`results/` of the checkout: every table, figure, golden file and study output goes here
    (or under a directory the user names), never relative to the working directory."""
    return project_root() / "results"


def default_records_dir() -> Path:
    return results_root() / "records"


def relative(path: str | Path, start: str | Path | None = None) -> str:
    """path relative to start (default: the project root) when inside it, else as given."""
    try:
        return str(Path(path).relative_to(start or project_root()))
    except ValueError:
        return str(path)


class CannotRunHere(RuntimeError):
    """The mode cannot run on this machine / in this build (exit code 3)."""


# ------------------------------------------------------------------------------- configs
def _resolve_paths(cfg: JobConfig) -> None:
    """Relative asset paths: as given if they exist from the working directory, else under the
    project root (where `python -m core.data.assets --all` puts `assets/`)."""
    for obj, key in ((cfg.tokenizer, "path"), (cfg.data, "path"), (cfg.checkpoint, "resume_from")):
        value = getattr(obj, key)
        if value and not os.path.isabs(value):
            p = Path(value)
            setattr(obj, key, str(p.resolve() if p.exists() else project_root() / p))


def resolve_config(
    recipe: Recipe, mode: str, overrides: list[str] | tuple[str, ...] = (), check_files: bool = False
) -> JobConfig:
    """Recipe overlay for the mode <- `--set` overrides, validated (ConfigError names the key)."""
    cfg = recipe.job_config(mode)
    for text in overrides:
        section, key, value = parse_override(text)
        apply_dict(cfg, {section: {key: value}}, "--set")
    _resolve_paths(cfg)
    cfg = validate(cfg, check_files=check_files)
    return cfg


def dry_run_available() -> bool:
    try:
        return importlib.util.find_spec("core.dryrun") is not None
    except ModuleNotFoundError:
        return False


# -------------------------------------------------------------------------------- commands
def torchrun_exe() -> str:
    exe = Path(sys.executable).with_name("torchrun")
    return str(exe) if exe.is_file() else "torchrun"


def torchrun_command(
    nproc: int,
    target: list[str] | tuple[str, ...],
    nnodes: int = 1,
    rdzv_id: str | None = None,
    rdzv_endpoint: str | None = None,
    max_restarts: int = 0,
    exe: str | None = None,
    launcher_args: list[str] | tuple[str, ...] = (),
    forked: bool = False,
) -> list[str]:
    """The one place a torchrun command is built. `target`: what each rank runs, e.g.
    `["-m", "core.train", "--config", path]` or a script and its arguments. One node without a
    rendezvous endpoint: `--standalone`; else a c10d rendezvous at `rdzv_endpoint`. `exe`: a
    torchrun executable (multi-node, sbatch); default `python -m torch.distributed.run` of
    this interpreter. `max_restarts`: torchrun's agent restarts the whole group when a rank
    dies; the trainer resumes from its latest complete checkpoint (checkpoint.enabled).
    `launcher_args`: more torchrun options, after the rank counts (e.g. `--numa-binding=node`).
    `forked` (proxy runs: one node, `-m MODULE` target): the same options to recipes/forked_run.py,
    torchrun's agent with the ranks forked from a process that has imported MODULE once."""
    if forked:
        if exe or rdzv_endpoint is not None or nnodes != 1 or list(target[:1]) != ["-m"]:
            raise ValueError("a forked launch is one node, --standalone, of a `-m MODULE` target")
        exe_args = [sys.executable, "-u", "-m", "recipes.forked_run"]
    else:
        exe_args = [exe] if exe else [sys.executable, "-m", "torch.distributed.run"]
    cmd = list(exe_args)
    if rdzv_endpoint is None:
        cmd.append("--standalone")
    cmd += [f"--nnodes={nnodes}", f"--nproc_per_node={nproc}"]
    cmd += list(launcher_args)
    if rdzv_endpoint is not None:
        cmd += [f"--rdzv_id={rdzv_id}", "--rdzv_backend=c10d", f"--rdzv_endpoint={rdzv_endpoint}"]
    if max_restarts:
        cmd.append(f"--max-restarts={max_restarts}")
    return cmd + list(target)


def trainer_target(config_path: Path | str | None = None, overrides: list[str] | tuple[str, ...] = ()) -> list[str]:
    """What each rank of a training run executes: `-m core.train [--config PATH] [overrides]`."""
    return ["-m", "core.train", *(["--config", str(config_path)] if config_path else []), *overrides]


# ----------------------------------------------------------------------------- run dirs
def make_run_dir(recipe: Recipe, out: str | Path | None, several: bool) -> Path:
    """--out DIR: DIR itself (DIR/<id__> when several recipes run); else runs/<id__>/<timestamp>."""
    if out:
        d = Path(out) / recipe.fname if several else Path(out)
    else:
        stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
        d = default_runs_dir() / recipe.fname / stamp
        n = 1
        while d.exists():
            d = d.with_name(f"{stamp}-{n}")
            n += 1
    d = d.resolve()
    d.mkdir(parents=True, exist_ok=True)
    return d


def write_job(cfg: JobConfig, run_dir: Path) -> Path:
    cfg.job.output_dir = str(run_dir)
    path = run_dir / "job.json"
    save_config(cfg, path)
    return path


def copy_record(result: Path, records_dir: Path | None, mode: str, recipe: Recipe) -> Path | None:
    if records_dir is None:
        return None
    return atomic_copy(result, Path(records_dir) / mode / f"{recipe.fname}.json")


def checkpoint_steps(cfg: JobConfig, run_dir: Path) -> list[int]:
    """Complete checkpoint steps the run in `run_dir` would resume from (torch-free scan)."""
    return list(complete_steps(Path(run_dir) / cfg.checkpoint.folder)) if cfg.checkpoint.enabled else []


def _resume_from_step(cfg: JobConfig) -> tuple[int, Path] | None:
    """(step, folder) a run starts at from checkpoint.resume_from (core.checkpoint.folder's
    choice, without torch); None when that choice fails: the trainer names why."""
    try:
        src = resolve_source(Path(cfg.checkpoint.resume_from), cfg.checkpoint.load_step)
        return start_step(src), src
    except CheckpointError:
        return None


def check_resume_step(cfg: JobConfig, run_dir: Path) -> None:
    """What can be checked of the checkpoint the run would resume from, before anything runs
    (ConfigError naming the key or the file): training.steps above its step; its model shape
    (titan.json) the run's."""
    steps = checkpoint_steps(cfg, run_dir)
    at = cfg.checkpoint.load_step if cfg.checkpoint.load_step >= 0 else (steps[-1] if steps else 0)
    where = run_dir / cfg.checkpoint.folder
    if not steps and cfg.checkpoint.enabled and cfg.checkpoint.resume_from:
        at, where = _resume_from_step(cfg) or (0, where)
    if at and at >= cfg.training.steps:
        raise ConfigError(
            f"training.steps: {cfg.training.steps} is not above the step {at} this run resumes "
            f"from ({where}); set training.steps > {at}"
        )
    if cfg.checkpoint.enabled:
        _check_resume_shape(cfg, run_dir)


def _check_resume_shape(cfg: JobConfig, run_dir: Path) -> None:
    try:
        path = resolve(run_dir / cfg.checkpoint.folder, cfg.checkpoint.load_step, cfg.checkpoint.resume_from)
    except CheckpointError:
        return  # the trainer names why, with the checkpoint's files in hand
    theirs = read_info(path).get("model_shape") if path is not None else None
    if not theirs:
        return
    vocab = None
    if cfg.data.dataset != "synthetic":
        from core.data.tokenizer import Tokenizer  # tiktoken: only when a checkpoint is there to check

        vocab = Tokenizer(cfg.tokenizer.path).n_words
    ours = model_shape(model_args(cfg, vocab))
    diff = [f"{k} {theirs.get(k)} (checkpoint) != {v} (this run)" for k, v in ours.items() if theirs.get(k) != v]
    if diff:
        raise ConfigError(
            f"model: {path / INFO} is a checkpoint of another model shape: {', '.join(diff)}; "
            "use another --out, or the run's own model settings"
        )


# ------------------------------------------------------------------------------ launching
def base_env(defaults: dict[str, str] | None = None, **set_vars: str) -> dict[str, str]:
    """The environment of every torchrun this project starts: this one, the checkout on the
    path, the checkout's persistent inductor cache unless one is set. `defaults`: a mode's own
    settings, where the caller's environment has none; `set_vars` are set as given (e.g.
    OMP_NUM_THREADS="1" where a test compares against an in-process reference)."""
    env = dict(os.environ)
    root = str(project_root())
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    for key, value in (defaults or {}).items():
        env.setdefault(key, value)
    env.setdefault("PYTHONUNBUFFERED", "1")
    # set from the start: torch's first cache lookup (at some imports) would fix its own default
    env.setdefault("TORCHINDUCTOR_CACHE_DIR", inductor_cache_dir())
    # pytorch#135712: workers restarted by torchrun (--max-restarts) on the rendezvous' shared
    # TCPStore can read the previous attempt's addresses (gloo: "connectFullMesh failed")
    env.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    env.update(set_vars)
    return env


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity where the OS has one)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def inductor_cache_dir() -> str:
    """A persistent inductor cache in the checkout: compiled rows compile once per machine."""
    return str(project_root() / ".cache" / "inductor")


def run_logged(
    cmd: list[str],
    env: dict[str, str],
    log_path: Path,
    echo: bool = False,
    timeout: float | None = None,
    cwd: Path | None = None,
) -> int:
    """Run cmd with its merged output in log_path, echoed as it comes when `echo`. Returns the
    exit code (-1 after `timeout` seconds: the process is killed)."""
    if echo:
        return stream(cmd, env, log_path)
    with open(log_path, "wb") as f:
        try:
            return subprocess.run(
                cmd, check=False, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=cwd, timeout=timeout
            ).returncode
        except subprocess.TimeoutExpired:
            return -1


def log_tail(log_path: Path, lines: int = 30) -> str:
    return "\n".join(Path(log_path).read_text(errors="replace").splitlines()[-lines:])


def run_dry(cfg: JobConfig, run_dir: Path, gpu: str | None = None, fake: bool = True) -> dict:
    """core.dryrun.record.dry_run at true scale (fake=False: the accounting without the fake
    step); the record it returns, completed with our fields."""
    if not dry_run_available():
        raise CannotRunHere("dry-run is not available in this build (core.dryrun is missing)")
    from core.dryrun.record import dry_run  # imports torch: only when a dry-run is asked for

    cfg.job.output_dir = str(run_dir)
    kwargs = {**({"gpu": gpu} if gpu else {}), **({} if fake else {"fake": False})}
    record = dict(dry_run(cfg, **kwargs))
    record.setdefault("recipe", cfg.job.recipe)
    record.setdefault("mode", "dry-run")
    record.setdefault("config", cfg.to_dict())
    record.setdefault("finished_at", datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))
    atomic_write_json(run_dir / "result.json", record, default=str)
    return record
