"""A run folder, from its making to its record: the one home of what `run-recipe run` does to a
folder before, around and after a run (recipes/modes.py calls it; the trainer takes its lock
under SLURM).

    <run_dir>/job.json      the resolved config the ranks read (`write_job`)
    <run_dir>/.run.lock     the run that owns the folder (`lock`)
    <run_dir>/checkpoint/   what a new run resumes from (`check_resume`; core/checkpoint/folder.py)
    <run_dir>/result.json   the record, copied to <records>/<mode>/<id__>.json (`copy_record`)

A run folder is owned by one run at a time: `.run.lock` names the holder (host, pid, start). The
launcher takes it for a local run; a job submitted to SLURM takes it in its rank 0 when it starts
(TITAN_RUN_LOCK, set by the sbatch script), so the folder is owned while it runs.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import socket
import sys
from pathlib import Path

from core.checkpoint.folder import INFO, CheckpointError, complete_steps, read_info, resolve, resolve_source, start_step
from core.config import ConfigError, JobConfig, save_config
from core.fileio import atomic_copy
from core.models.args import model_args, model_shape

LOCK = ".run.lock"
RUN_LOCK_ENV = "TITAN_RUN_LOCK"  # "1": the trainer's rank 0 takes the lock of each job's folder


class RunDirBusy(RuntimeError):
    """The run folder is owned by another live run (exit code 2: nothing was spawned)."""


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    return True


# ---------------------------------------------------------------------------------- the lock
@contextlib.contextmanager
def lock(run_dir: Path):
    """Own `run_dir` for one run: `<run_dir>/.run.lock` names the holder (host, pid, start). A
    second run is refused naming the holder; a lock of a dead process on this host is stale:
    reported and taken over. Released (removed) when the block ends."""
    lock = Path(run_dir) / LOCK
    me = {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    for _ in range(2):
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            try:
                holder = json.loads(lock.read_text())
            except (OSError, json.JSONDecodeError):
                holder = {}
            if (
                holder.get("host") == me["host"]
                and isinstance(holder.get("pid"), int)
                and not _pid_alive(holder["pid"])
            ):
                print(  # stderr, not the log: the CLI's own line before anything runs
                    f"note: {lock}: stale lock of pid {holder['pid']} on {holder['host']} (started "
                    f"{holder.get('started', '?')}, no longer running): taken over",
                    file=sys.stderr,
                )
                lock.unlink(missing_ok=True)
                continue
            who = (
                f"pid {holder.get('pid')} on host {holder.get('host')} since {holder.get('started')}"
                if holder
                else "an unreadable lock"
            )
            hint = (
                "" if holder.get("host") == me["host"] else " (another host: if that run is dead, remove the lock file)"
            )
            raise RunDirBusy(
                f"{run_dir}: in use by another run ({who}; lock file {lock}){hint}; use another --out"
            ) from None
        with os.fdopen(fd, "w") as f:
            json.dump(me, f)
        break
    else:
        raise RunDirBusy(f"{run_dir}: could not take the lock {lock}")
    try:
        yield lock
    finally:
        try:
            if json.loads(lock.read_text()).get("pid") == me["pid"]:
                lock.unlink()
        except (OSError, json.JSONDecodeError):
            pass


# ------------------------------------------------------------------------- making and claiming
def make(name: str, out: str | Path | None, several: bool, runs_root: Path) -> Path:
    """--out DIR: DIR itself (DIR/<name> when several rows run); else <runs_root>/<name>/<timestamp>."""
    if out:
        d = Path(out) / name if several else Path(out)
    else:
        stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
        d = runs_root / name / stamp
        n = 1
        while d.exists():
            d = d.with_name(f"{stamp}-{n}")
            n += 1
    d = d.resolve()
    d.mkdir(parents=True, exist_ok=True)
    return d


def claim(locks: contextlib.ExitStack, cfg: JobConfig, run_dir: Path) -> None:
    """Own `run_dir` until `locks` closes and check what the run would resume from there
    (RunDirBusy naming the holder; ConfigError naming the key or the file)."""
    locks.enter_context(lock(run_dir))
    check_resume(cfg, run_dir)


def write_job(cfg: JobConfig, run_dir: Path) -> Path:
    """`<run_dir>/job.json`: the config the ranks read, its output folder set to `run_dir`."""
    cfg.job.output_dir = str(run_dir)
    path = run_dir / "job.json"
    save_config(cfg, path)
    return path


def copy_record(result: Path, records_dir: Path | None, mode: str, name: str) -> Path | None:
    """The run's record copied to <records_dir>/<mode>/<name>.json (none without a folder)."""
    if records_dir is None:
        return None
    return atomic_copy(result, Path(records_dir) / mode / f"{name}.json")


# ------------------------------------------------------------------------------ resume checks
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


def check_resume(cfg: JobConfig, run_dir: Path) -> None:
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
