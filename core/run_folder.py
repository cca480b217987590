"""A run folder, from its making to its record: the one home of what `run-recipe run` does to a
folder before, around and after a run (recipes/modes.py calls it; the trainer takes its lock
under SLURM).

    <run_dir>/job.json      the resolved config the ranks read (`write_job`)
    <run_dir>/.run.lock     the run that owns the folder (`lock`), flocked by it and its ranks (`hold`)
    <run_dir>/checkpoint/   what a new run resumes from (`check_resume`; core/checkpoint/folder.py)
    <run_dir>/result.json   the record, copied to <records>/<mode>/<id__>.json (`copy_record`)

A run folder is owned by one run at a time: `.run.lock` names the holder (host, pid, start). The
launcher takes it for a local run; a job submitted to SLURM takes it in its rank 0 when it starts
(TITAN_RUN_LOCK, set by the sbatch script), so the folder is owned while it runs. A dead run's
lock is taken over by the next run with a note: on the same host as soon as no process holds its
flock, on another host once its heartbeat stops (a job resubmitted after the node died).
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import fcntl
import json
import os
import socket
import sys
import threading
import time
from pathlib import Path

from core.checkpoint.folder import INFO, CheckpointError, complete_steps, read_info, resolve, resolve_source, start_step
from core.config import Checkpoint, ConfigError, JobConfig, flatten_keys, save_config
from core.fileio import atomic_copy
from core.models.args import model_args, model_shape

LOCK = ".run.lock"
RUN_LOCK_ENV = "TITAN_RUN_LOCK"  # "1": the trainer's rank 0 takes the lock of each job's folder
HEARTBEAT_S = 30.0  # the owner touches its lock this often ...
STALE_AFTER_S = 300.0  # ... so a lock of another host untouched this long is a dead run's
_NO_FLOCK = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)  # a file system without flock
_WRITER_HOLDS: list[int] = []  # this process's shared holds (a rank's), kept until it exits
_OWNED: set[Path] = set()  # the locks this process owns (it needs no second hold of them)


class RunDirBusy(RuntimeError):
    """The run folder is owned by another live run (exit code 2: nothing was spawned)."""


class RunDirRefused(ConfigError):
    """--out names a folder that is not a run's to write in: files of something else, or the
    checkout itself (a ConfigError: exit code 2, nothing written, nothing spawned)."""


def _start_ticks(pid: int) -> int | None:
    """When process `pid` started (clock ticks since boot): a pid reused by another process has
    another start."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def _flock(fd: int, how: int) -> bool | None:
    """flock(2) without blocking: True taken, False held by a live process, None unsupported."""
    try:
        fcntl.flock(fd, how | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    except OSError as e:
        if e.errno in _NO_FLOCK:
            return None
        raise


def _describe(holder: dict | None, size: int) -> str:
    if holder is None:
        return f"an unreadable lock file ({size} bytes)"
    return f"pid {holder.get('pid')} on host {holder.get('host')} since {holder.get('started')}"


def _stale_because(holder: dict | None, size: int, flocked: bool | None, age_s: float) -> str | None:
    """Why a lock whose holder this process could not see is a dead run's, or None (live).
    The kernel's flock answers for this host (a dead process holds no lock, a reused pid does
    not inherit one); another host's run touches its lock every HEARTBEAT_S."""
    what = _describe(holder, size)
    same_host = holder is not None and holder.get("host") == socket.gethostname()
    if flocked and (same_host or holder is None):
        return f"{what}, held by no live process"
    if same_host:  # no flock here: the pid, and when it started
        pid = holder.get("pid") if holder else None
        if isinstance(pid, int) and _start_ticks(pid) is not None and _start_ticks(pid) == holder.get("pid_start"):
            return None
        return f"{what}, no longer running"
    if age_s > STALE_AFTER_S:
        return f"{what}, untouched for {age_s / 60:.0f} min (a live run touches it every {HEARTBEAT_S:.0f} s)"
    return None


def _busy(run_dir: Path, path: Path, holder: dict | None, size: int, age_s: float) -> RunDirBusy:
    what = _describe(holder, size)
    if holder is not None and holder.get("host") not in (None, socket.gethostname()):
        left = max(0.0, STALE_AFTER_S - age_s)
        what += f", touched {age_s:.0f} s ago: taken over if untouched for {left:.0f} s more"
    return RunDirBusy(f"{run_dir}: in use by another run ({what}; lock file {path}); use another --out")


def _read_holder(fd: int) -> tuple[dict | None, int, float]:
    """(the holder named in the lock, the file's size, seconds since it was last touched)."""
    st = os.fstat(fd)
    try:
        holder = json.loads(os.pread(fd, 4096, 0).decode()) if st.st_size else None
    except (OSError, ValueError):
        holder = None
    return (holder if isinstance(holder, dict) else None), st.st_size, time.time() - st.st_mtime


def _open_current(path: Path) -> tuple[int, bool | None, bool]:
    """(fd, flocked, existed): the lock file opened (made if missing) and flocked exclusively when
    free; retried while another owner releases it (removes the file) under our feet."""
    while True:
        try:
            fd, existed = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644), False
        except FileExistsError:
            try:
                fd, existed = os.open(path, os.O_RDWR), True
            except FileNotFoundError:
                continue
        flocked = _flock(fd, fcntl.LOCK_EX)
        try:
            if os.fstat(fd).st_ino == os.stat(path).st_ino:
                return fd, flocked, existed
        except FileNotFoundError:
            pass
        os.close(fd)


class _Heartbeat(threading.Thread):
    """Touches the lock every HEARTBEAT_S while the run lives: how another host tells it alive."""

    def __init__(self, path: Path):
        super().__init__(name="run-lock-heartbeat", daemon=True)
        self.path, self.stopped = path, threading.Event()

    def run(self) -> None:
        while not self.stopped.wait(HEARTBEAT_S):
            with contextlib.suppress(OSError):
                os.utime(self.path)


# ---------------------------------------------------------------------------------- the lock
@contextlib.contextmanager
def lock(run_dir: Path):
    """Own `run_dir` for one run: `<run_dir>/.run.lock` names the holder (host, pid, start) and
    is flocked for the run's life by the owner and every rank (`hold`), so the kernel frees it
    when the last of them dies, however it dies. A second run is refused naming the holder while
    any of them lives (or, on another host, while the owner touches the lock); a dead run's lock
    is taken over with a note. Released (removed) when the block ends."""
    path = Path(run_dir) / LOCK
    fd, flocked, existed = _open_current(path)
    try:
        holder, size, age = _read_holder(fd)
        if flocked is False:
            raise _busy(Path(run_dir), path, holder, size, age)
        if existed:
            why = _stale_because(holder, size, flocked, age)
            if why is None:
                raise _busy(Path(run_dir), path, holder, size, age)
            print(f"note: {path}: {why}: taken over", file=sys.stderr)  # the CLI's own line
        me = _write_holder(fd, path, created=not existed)
    except BaseException:
        os.close(fd)
        raise
    if flocked:
        fcntl.flock(fd, fcntl.LOCK_SH)  # the ranks hold it shared beside us
    heartbeat = _Heartbeat(path)
    heartbeat.start()
    _OWNED.add(path.resolve())
    try:
        yield path
    finally:
        _OWNED.discard(path.resolve())
        heartbeat.stopped.set()
        _release(fd, path, me, flocked)


def _write_holder(fd: int, path: Path, created: bool) -> dict:
    me = {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "pid_start": _start_ticks(os.getpid()),
        "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    data = json.dumps(me).encode()
    try:
        os.ftruncate(fd, 0)
        if os.pwrite(fd, data, 0) != len(data):
            raise OSError(errno.ENOSPC, "short write", str(path))
        os.fsync(fd)
    except OSError as e:  # a full disk: no 0-byte lock left behind to block the folder
        if created:
            path.unlink(missing_ok=True)
        raise OSError(e.errno, e.strerror, str(path)) from None
    return me


def _release(fd: int, path: Path, me: dict, flocked: bool | None) -> None:
    """Remove our lock unless a rank still holds it (it goes with that rank), then let go."""
    try:
        holder, _, _ = _read_holder(fd)
        ours = holder is not None and holder.get("pid") == me["pid"] and holder.get("host") == me["host"]
        if ours and flocked is not False and _flock(fd, fcntl.LOCK_EX) is not False:
            path.unlink(missing_ok=True)
    except OSError:
        pass
    finally:
        os.close(fd)


def hold(run_dir: Path, wait_s: float = 5.0) -> None:
    """A rank writing into `run_dir` holds its lock shared until the rank exits: a launcher that
    died cannot have its folder taken over while its ranks still write there. No lock file (a
    run without an owner), or a file system without flock: nothing held."""
    path = Path(run_dir) / LOCK
    if path.resolve() in _OWNED:
        return
    try:
        fd = os.open(path, os.O_RDWR)
    except OSError:
        return
    deadline = time.monotonic() + wait_s
    while (taken := _flock(fd, fcntl.LOCK_SH)) is False and time.monotonic() < deadline:
        time.sleep(0.05)  # the owner is between its exclusive check and its shared hold
    if taken:
        _WRITER_HOLDS.append(fd)
    else:
        os.close(fd)


def lock_for_job(folders: list[Path], owned: contextlib.ExitStack) -> None:
    """In a job's ranks (SLURM: no launcher owns the folders): rank 0 takes each folder's lock,
    held until `owned` closes; every rank learns whether it could, and raises RunDirBusy alike
    when not."""
    import torch.distributed as dist  # here: the launcher imports this module without torch

    busy: list[str | None] = [None]
    if dist.get_rank() == 0:
        try:
            for folder in folders:
                owned.enter_context(lock(folder))
        except RunDirBusy as e:
            busy = [str(e)]
    dist.broadcast_object_list(busy, src=0)
    if busy[0] is not None:
        raise RunDirBusy(busy[0])


# ------------------------------------------------------------------------- making and claiming
# What a run puts in its folder (the list above; `lock` and `write_job` first of all): a folder
# holding any of them is a run's, which a new run may own and resume; other files are someone else's.
RUN_MARKS = (LOCK, "job.json", "result.json", Checkpoint().folder)
SHOWN_ENTRIES = 5  # the entries a refusal names


def checkout_root() -> Path | None:
    """The source checkout this module runs from (pyproject.toml and core/), None when installed;
    found as core/data/store.py finds assets/ (core never imports recipes/)."""
    repo = Path(__file__).resolve().parents[1]
    return repo if (repo / "pyproject.toml").is_file() and (repo / "core").is_dir() else None


def check_out_folder(run_dir: Path, given: Path | None = None) -> None:
    """Refuse (RunDirRefused) a run folder that would mix the run's files with others': one that
    holds files but no run (its config.json, notes or train.log would be overwritten or appended
    to), or the checkout's root or a folder above it (`given`: DIR too when several rows run in
    DIR/<id>). An empty, missing or earlier run's folder is fine. Nothing is written."""
    root = checkout_root()
    for d in (run_dir, given):
        if d is not None and root is not None and root.is_relative_to(d.resolve()):
            what = "is the checkout's root" if d.resolve() == root else f"holds the checkout ({root})"
            raise RunDirRefused(
                f"--out: {d} {what}: a run would write its files among the project's; give a folder of "
                "its own (without --out, runs go to runs/<id>/<timestamp>)"
            )
    if not run_dir.is_dir() or any((run_dir / mark).exists() for mark in RUN_MARKS):
        return
    entries = sorted(p.name + ("/" if p.is_dir() else "") for p in run_dir.iterdir())
    if not entries:
        return
    more = len(entries) - SHOWN_ENTRIES
    shown = ", ".join(entries[:SHOWN_ENTRIES]) + (f" and {more} more" if more > 0 else "")
    raise RunDirRefused(
        f"--out: {run_dir} is not empty and holds no run (no {', '.join(RUN_MARKS)}): {shown}; a run "
        "would overwrite or append to them: give an empty or new folder"
    )


def make(name: str, out: str | Path | None, several: bool, runs_root: Path) -> Path:
    """--out DIR: DIR itself (DIR/<name> when several rows run); else <runs_root>/<name>/<timestamp>.
    A folder that is not a run's to write in is refused first (check_out_folder)."""
    if out:
        d = Path(out) / name if several else Path(out)
        check_out_folder(d.resolve(), Path(out).resolve() if several else None)
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


def claim(locks: contextlib.ExitStack, cfg: JobConfig, run_dir: Path) -> str | None:
    """Own `run_dir` until `locks` closes and check what the run would resume from there
    (RunDirBusy naming the holder; ConfigError naming the key or the file). Returns the note a
    resume prints: what this run changes from the checkpoint's."""
    locks.enter_context(lock(run_dir))
    check_same_recipe(cfg, run_dir)
    return check_resume(cfg, run_dir)


def check_same_recipe(cfg: JobConfig, run_dir: Path) -> None:
    """A folder holding another recipe's run is not this run's to resume, nor its record to
    overwrite (ConfigError): its checkpoint is started from only when asked (resume_from)."""
    try:
        theirs = json.loads((run_dir / "job.json").read_text()).get("job", {}).get("recipe", "")
    except (OSError, ValueError, AttributeError):
        return
    if theirs and cfg.job.recipe and theirs != cfg.job.recipe:
        raise ConfigError(
            f"--out: {run_dir} holds a run of {theirs}, not {cfg.job.recipe}; use another --out (to start "
            f"from its checkpoint: --set checkpoint.resume_from='{run_dir / cfg.checkpoint.folder}')"
        )


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


def check_resume(cfg: JobConfig, run_dir: Path) -> str | None:
    """What can be checked of the checkpoint the run would resume from, before anything runs
    (ConfigError naming the key or the file): training.steps above its step; its model shape
    (titan.json) the run's; no change a resume cannot make. Returns the line that says what this
    run changes from the checkpoint's config (applied from the next step), if anything."""
    steps = checkpoint_steps(cfg, run_dir)
    at = cfg.checkpoint.load_step if cfg.checkpoint.load_step >= 0 else (steps[-1] if steps else 0)
    where = run_dir / cfg.checkpoint.folder
    if not steps and cfg.checkpoint.enabled and cfg.checkpoint.resume_from:
        at, where = _resume_from_step(cfg) or (0, where)
    if steps and cfg.checkpoint.create_seed_checkpoint:
        raise ConfigError(
            f"checkpoint.create_seed_checkpoint: {where} already holds checkpoints (step {steps[-1]}): a seed is "
            "a new run's initial weights; use another --out"
        )
    if at and at >= cfg.training.steps:
        raise ConfigError(
            f"training.steps: {cfg.training.steps} is not above the step {at} this run resumes "
            f"from ({where}); set training.steps > {at}"
        )
    if not cfg.checkpoint.enabled:
        return None
    _check_resume_shape(cfg, run_dir)
    return _resume_changes(cfg, run_dir, at)


# Keys a resume cannot change: the loader's saved position and the vocabulary are of these.
NOT_ON_RESUME = ("data.dataset", "data.path", "data.sharding", "tokenizer.path")
# Sections that say where and how a run is watched, not what it trains.
NOT_COMPARED = ("job.", "checkpoint.", "metrics.", "profiling.", "comm.")


def _resume_changes(cfg: JobConfig, run_dir: Path, at: int) -> str | None:
    try:
        path = resolve(run_dir / cfg.checkpoint.folder, cfg.checkpoint.load_step, cfg.checkpoint.resume_from)
        theirs = read_info(path).get("config") if path is not None else None
    except (CheckpointError, OSError):
        return None  # the trainer names why, with the checkpoint's files in hand
    if not theirs:
        return None  # a checkpoint of before configs were saved with it
    old, new = flatten_keys(theirs), flatten_keys(cfg.to_dict())
    changed = [k for k in sorted(new) if not k.startswith(NOT_COMPARED) and k in old and old[k] != new[k]]
    refused = [k for k in changed if k in NOT_ON_RESUME]
    if refused:
        raise ConfigError(
            f"{refused[0]}: {old[refused[0]]!r} in the checkpoint at step {at} ({path}), {new[refused[0]]!r} here: "
            "a resume continues the checkpoint's data; use another --out to start a new run"
        )
    if not changed:
        return None
    said = ", ".join(f"{k} {old[k]!r} -> {new[k]!r}" for k in changed)
    return (
        f"resuming from step {at} with this run's settings from step {at + 1} on (the LR schedule and the "
        f"optimizer follow them): {said}"
    )


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
