"""This process's life as a rank: how long it took to start, and how it exits."""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import fcntl
import multiprocessing
import os
import re
import signal
import sys
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

# Set by a launcher that imports the trainer once and forks the ranks (recipes/forked_run.py):
# its own age at the fork, which is the start-up and imports every rank inherits.
FORKED_AT_AGE_ENV = "TITAN_FORKED_AT_AGE_S"
PR_SET_PDEATHSIG = 1  # linux/prctl.h


def process_age_s() -> float | None:
    """Seconds since this process started (Linux /proc), i.e. interpreter start-up + imports so far;
    a forked rank adds the age its launcher had at the fork."""
    try:
        start_ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        age = float(Path("/proc/uptime").read_text().split()[0]) - start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None
    return age + float(os.environ.get(FORKED_AT_AGE_ENV, 0.0))


def exit_process(rc: int) -> None:
    """Exit a finished rank without the interpreter's teardown of torch's object graph: measured
    0.65 s of CPU per rank, 18 s for 16 ranks on 2 cores. atexit handlers and the streams still
    run and flush; a live non-daemon thread (one still writing) gets a normal exit instead. A
    rank forked by multiprocessing (recipes/forked_run.py) returns on success: its parent waits
    for the return value, and the fork's own exit skips the teardown anyway."""
    if rc == 0 and multiprocessing.parent_process() is not None:
        return
    if any(t.is_alive() and not t.daemon for t in threading.enumerate() if t is not threading.main_thread()):
        sys.exit(rc)
    # private, no public equivalent: run the atexit handlers before os._exit skips them
    # (tests/test_torch_internals.py)
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)


def die_with_parent(signum: int = signal.SIGTERM) -> None:
    """Have the kernel send `signum` to this process when its parent dies (Linux
    PR_SET_PDEATHSIG), so that ranks and their agent never outlive a launcher that was killed
    (SIGKILL, the OOM killer) or hung up; the signal then stops them as a SIGTERM from torchrun
    does. Elsewhere a no-op. Called by the process itself, from its main thread: the kernel ties
    the signal to the thread that forked it."""
    if not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signum, 0, 0, 0)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # the parent died before the request: as if it had died after
        os.kill(os.getpid(), signum)


def raise_open_file_limit() -> tuple[int, int]:
    """Raise this process's soft limit of open files to its hard limit, as the sbatch script does
    for the job (`ulimit -n $(ulimit -Hn)`): gloo keeps a socket per peer in each of its three or
    four groups, which at 512 ranks passes a soft 1024 inherited through SLURM. A hard limit of
    'unlimited' is capped at the kernel's fs.nr_open. Returns (soft before, soft after); where the
    system has no such limit, or refuses, the limit stays as it was."""
    try:
        import resource  # POSIX only
    except ImportError:
        return (-1, -1)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard
    if hard == resource.RLIM_INFINITY:
        try:
            target = int(Path("/proc/sys/fs/nr_open").read_text())
        except (OSError, ValueError):
            return (soft, soft)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError):
            return (soft, soft)
    return (soft, resource.getrlimit(resource.RLIMIT_NOFILE)[0])


# ------------------------------------------------------------------ a node's answer, found once
def once_per_node(name: str, compute: Callable[[], str]) -> str:
    """`compute()`'s answer (one line of text) found by one rank of this node's launch and read by
    the others, for a probe too slow to run on every rank (nvidia-smi: core/toggles/async_tp.py).
    The ranks of one torchrun agent (TORCHELASTIC_RUN_ID, and the agent: their parent) share a
    file in this user's folder of the node's temp folder; the first to lock it computes and writes,
    the others wait for the lock and read. Outside torchrun, or without that folder: computed here."""
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    if not run_id:
        return compute()
    folder = Path(tempfile.gettempdir()) / f"titan_node_{os.getuid()}"
    key = re.sub(r"[^\w.-]", "_", f"{run_id}.{os.getppid()}.{name}")[:200]
    try:
        folder.mkdir(mode=0o700, exist_ok=True)
        if folder.stat().st_uid != os.getuid():  # another user's folder: nothing in it is trusted
            return compute()
        with open(folder / key, "a+") as f:
            fcntl.flock(f, fcntl.LOCK_EX)  # released when the file closes
            f.seek(0)
            known = f.read()
            if known.endswith("\n"):  # a whole answer (one cut short by a killed rank is found again)
                return known[:-1]
            value = compute()
            f.truncate(0)
            f.write(value + "\n")
            return value
    except OSError:
        return compute()


# ------------------------------------------------------------------ which rank died, and how
RANK_PIDS_ENV = "TITAN_RANK_PIDS"  # a folder where each rank leaves its pid, named by its rank
QUIET_DEATHS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)  # how an agent stops its ranks


def record_rank_pid() -> None:
    """A rank tells its agent's watcher its pid (core.train calls it first thing)."""
    folder, rank = os.environ.get(RANK_PIDS_ENV), os.environ.get("RANK")
    if folder and rank is not None:
        with contextlib.suppress(OSError):
            Path(folder, rank).write_text(str(os.getpid()))


class RankDeaths:
    """In an agent (recipes/agent.py, recipes/forked_run.py): says the moment one of its ranks is
    killed by a signal (SIGKILL from the OOM killer, a segfault), as an error line naming it. Such
    a rank writes nothing, and the survivors then fail on a lost connection, which torchrun may
    well observe first: without this line the rank that died would go unnamed. Runs on SIGCHLD
    (no thread: the ranks are forked after it is set up) and reads each exit without reaping it
    (WNOWAIT): torchrun's own bookkeeping still sees it."""

    def __init__(self, folder: Path):
        self.folder, self.said = folder, set()

    def __call__(self, signum=None, frame=None) -> None:
        with contextlib.suppress(OSError):
            for entry in os.scandir(self.folder):
                if entry.name not in self.said:
                    self._check(entry)

    def _check(self, entry) -> None:
        try:
            pid = int(Path(entry.path).read_text())
            info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except (OSError, ValueError):
            return
        if info is None:
            return
        self.said.add(entry.name)
        if info.si_code in (os.CLD_KILLED, os.CLD_DUMPED) and info.si_status not in QUIET_DEATHS:
            name = signal.Signals(info.si_status).name
            print(f"error: rank {entry.name} (pid {pid}) was killed by {name}", file=sys.stderr, flush=True)


def watch_rank_deaths() -> None:
    """An agent's set-up: a folder for its ranks' pids (inherited through the environment) and
    the SIGCHLD handler that looks at them (a forked rank puts SIGCHLD back: `forget_rank_deaths`)."""
    folder = Path(tempfile.mkdtemp(prefix="titan_ranks_"))
    os.environ[RANK_PIDS_ENV] = str(folder)
    signal.signal(signal.SIGCHLD, RankDeaths(folder))


def forget_rank_deaths() -> None:
    """In a rank forked by the agent: its own children (DCP's checkpoint process) are not ranks."""
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
