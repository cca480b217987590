"""A run folder is owned by one run at a time: `<run_dir>/.run.lock` names the holder (host, pid,
start). The launcher takes it for a local run; a job submitted to SLURM takes it in its rank 0
when it starts (TITAN_RUN_LOCK, set by the sbatch script), so the folder is owned while it runs."""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import socket
import sys
from pathlib import Path

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


@contextlib.contextmanager
def run_dir_lock(run_dir: Path):
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
