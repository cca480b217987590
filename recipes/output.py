"""A launched process's output: echoed as it comes and kept in a log, or, for a multi-job launch
of core.train, split into each job's own log. Every write reaches the file at once, so a killed
launcher leaves the log up to that moment; a log that exists (a resumed run) is appended to,
after a separator line. A signal to the launcher stops the whole launch (`Stopped`), and a failed
launch's cause is found in its log (`failure_cause`).
"""

from __future__ import annotations

import codecs
import contextlib
import datetime
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from core.config import JOB_MARKER
from core.logs import PROGRESS_TTY_ENV

SEPARATOR = "===== run-recipe: a new launch"  # starts the line that opens each launch in a reused log
STOP_GRACE_S = 30.0  # torchrun's agent stops its ranks on SIGTERM; after this the group is killed


class Stopped(BaseException):
    """The launcher was asked to stop (SIGINT, SIGTERM, SIGHUP); the launch was stopped with it.
    A BaseException, as KeyboardInterrupt: no `except Exception` on the way may swallow it."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum
        self.rows: list = []  # the rows whose launch it stopped (recipes/modes.py fills it)

    @property
    def exit_code(self) -> int:
        return 128 + self.signum  # the shell's convention: 130 for SIGINT, 143 for SIGTERM, 129 for SIGHUP


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


@contextlib.contextmanager
def stop_on_signals():
    """SIGINT, SIGTERM and SIGHUP (a closed terminal or SSH session) raise Stopped, so that the
    launch is stopped, locks released and one line said; the previous handlers come back after.
    Installed whatever this process inherited: a launcher started in the background of a
    non-interactive shell inherits SIGINT ignored, and would never hear it; only SIGHUP ignored
    on purpose (nohup) stays ignored. Once stopping, further signals wait for the stop to end."""
    stopping = False

    def handler(signum, frame):
        nonlocal stopping
        if not stopping:
            stopping = True
            raise Stopped(signum)

    previous = {}
    for signum in STOP_SIGNALS:
        if signum == signal.SIGHUP and signal.getsignal(signum) == signal.SIG_IGN:
            continue
        previous[signum] = signal.signal(signum, handler)
    try:
        yield
    except KeyboardInterrupt:
        raise Stopped(signal.SIGINT) from None
    finally:
        for signum, before in previous.items():
            signal.signal(signum, before)


def _open_log(path: Path):
    """Append, unbuffered; a log with content gets a separator line first."""
    f = open(path, "ab", buffering=0)  # noqa: SIM115 - kept open for the launch, closed by JobLogs.close()
    if f.tell():
        stamp = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        f.write(f"\n{SEPARATOR}, {stamp} =====\n".encode())
    return f


class JobLogs:
    """Where a launch's output goes: one log, or, for a multi-job launch, each job's own log from
    the JOB_MARKER line core.train prints before it (the marker lines are not echoed). A write
    that fails (a full disk) stops the logging, never the launch: `error` says what happened."""

    def __init__(self, first: Path, by_output_dir: dict[str, Path] | None = None):
        self.by_output_dir = {str(Path(d).resolve()): log for d, log in (by_output_dir or {}).items()}
        self.path = Path(first)
        self.file = _open_log(self.path)
        self.pending = ""  # a partial line that may still become a marker
        self.partial = ""  # the file's line in progress (its last frame, when redrawn)
        self.line_ended = True
        self.error: str | None = None

    def _file_write(self, text: str) -> None:
        """Whole lines to the file; a line redrawn with carriage returns (a progress bar) keeps
        only its last frame, so the log holds lines a person reads, never a bar's every redraw."""
        if self.file is None:
            return
        lines = (self.partial + text).split("\n")
        self.partial = lines.pop().rsplit("\r", 1)[-1]
        kept = [line.rsplit("\r", 1)[-1] for line in lines]
        data = "".join(k + "\n" for k, line in zip(kept, lines, strict=True) if k or "\r" not in line)
        try:
            self.file.write(data.encode())
        except OSError as e:
            self.error = f"{self.path}: stopped logging: {e.strerror or e}"
            with contextlib.suppress(OSError):
                self.file.close()
            self.file = None

    def _flush_partial(self) -> None:
        if self.partial:
            self._file_write("\n")

    def write(self, text: str) -> str:
        """Log `text`; returns what to echo."""
        if not self.by_output_dir:
            self._file_write(text)
            return text
        echo: list[str] = []
        lines = (self.pending + text).split("\n")
        self.pending = lines.pop()
        for line in lines:
            at = line.find(JOB_MARKER + " ")  # after a progress bar's last redraw, on its line
            if at >= 0:
                before = line[:at] + ("\n" if at or not self.line_ended else "")
                self._write(before, echo)
                self._switch(line[at + len(JOB_MARKER) + 1 :].strip())
            else:
                self._write(line + "\n", echo)
        if "@" not in self.pending:  # a marker may be on its way: held until its line ends
            self._write(self.pending, echo)  # progress bars redraw without a newline
            self.pending = ""
        return "".join(echo)

    def _write(self, text: str, echo: list[str]) -> None:
        if text:
            self._file_write(text)
            echo.append(text)
            self.line_ended = text.endswith("\n")

    def _switch(self, output_dir: str) -> None:
        path = self.by_output_dir.get(str(Path(output_dir).resolve()))
        if path is not None and path != self.path:
            self._flush_partial()
            if self.file is not None:
                self.file.close()
            self.path = path
            try:
                self.file = _open_log(path)
            except OSError as e:
                self.file, self.error = None, f"{path}: cannot open: {e.strerror or e}"

    def close(self) -> str:
        rest, self.pending = self.pending, ""
        self._file_write(rest)
        self._flush_partial()
        if self.file is not None:
            self.file.close()
        return rest


def _stop(proc: subprocess.Popen) -> None:
    """Stop a launch started in its own session: SIGTERM to torchrun (its agent stops the ranks),
    then SIGKILL to whatever of the session is left after STOP_GRACE_S, so no rank outlives us."""
    with contextlib.suppress(ProcessLookupError):
        proc.send_signal(signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=STOP_GRACE_S)
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline:  # the ranks leave after the agent: wait for the session to empty
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.05)
    else:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=5.0)


_ELASTIC_LOG = re.compile(r"^[IWE]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ \S+:\d+\] ")  # torch.distributed's glog lines
# a traceback, or Python's report of an exception it could not raise (a generator closed at exit)
_TRACEBACK = re.compile(r"^(\[rank\d+\]:\s*)?(Traceback \(most recent call last\):|Exception ignored in)")
_SIGNALLED = re.compile(r"Process \d+ got signal: \d+")
_CHAINED = ("During handling of the above exception", "The above exception was the direct cause")


class TerminalEcho:
    """What of a launch's output a person sees on the terminal (all of it stays in train.log): the
    ranks' lines and progress, not the failure reports that follow a rank's failure (tracebacks,
    torchrun's agent lines and its ChildFailedError report): the launcher says the failed rank and
    its cause in one line at the end. `verbose` echoes everything."""

    def __init__(self, verbose: bool = False):
        self.verbose, self.partial = verbose, ""
        self.in_traceback = self.in_report = False
        self.report_rules = 0

    def filter(self, text: str) -> str:
        if self.verbose:
            return text
        lines = (self.partial + text).split("\n")
        self.partial = lines.pop()
        shown = [line + "\n" for line in lines if self._shown(line)]
        if "\r" in self.partial:  # a progress bar's redraw: shown as it comes
            shown.append(self.partial)
            self.partial = ""
        return "".join(shown)

    def _shown(self, line: str) -> bool:
        bare = re.sub(r"^\[rank\d+\]:\s?", "", line.rsplit("\r", 1)[-1])
        if self.in_report:  # ChildFailedError's block: between its first and last rule of ='s
            self.report_rules += bare.startswith("=====")
            self.in_report = self.report_rules < 2
            return False
        if _TRACEBACK.match(line) or (self.in_traceback and (bare[:1].isspace() or bare.startswith(_CHAINED))):
            self.in_traceback = True
            return False
        if self.in_traceback:  # the exception's own line closes the block
            self.in_traceback = False
            self.in_report, self.report_rules = "ChildFailedError" in bare, 0
            return False
        # a rank's one-line report of its exception (the launcher's last line names the first), and
        # what a rank says as torchrun's SIGTERM interrupts it ("Process N got signal: 15")
        return not (_ELASTIC_LOG.match(bare) or (bare != line and _EXCEPTION.match(bare)) or _SIGNALLED.search(bare))

    def close(self) -> str:
        rest, self.partial = self.partial, ""
        return rest if self.verbose or self._shown(rest) else ""


def stream(
    cmd: list[str],
    env: dict[str, str],
    log_path: Path,
    out=None,
    job_logs: dict[str, Path] | None = None,
    verbose: bool = False,
) -> int:
    """Run cmd, copying its merged stdout/stderr to `out` (default sys.stdout; failure reports
    left to the log, TerminalEcho) and log_path as it comes (chunks, so progress bars are not held
    back until a newline). `job_logs` (output dir -> log) splits a multi-job launch's output per
    job, log_path taking what precedes the first. The ranks learn whether `out` is a terminal
    (a progress bar, or a line per logged step). A Stopped (or Ctrl-C) stops the launch and is
    raised again."""
    out = out or sys.stdout
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    logs, echo = JobLogs(log_path, job_logs), TerminalEcho(verbose)
    env = {**env, PROGRESS_TTY_ENV: "1" if out.isatty() else "0"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        fd = proc.stdout.fileno()
        while True:
            chunk = os.read(fd, 65536)
            if not chunk:
                break
            out.write(echo.filter(logs.write(decoder.decode(chunk))))
            out.flush()
        return proc.wait()
    except (Stopped, KeyboardInterrupt) as e:
        _stop(proc)
        raise (e if isinstance(e, Stopped) else Stopped(signal.SIGINT)) from None
    finally:
        out.write(echo.filter(logs.close()) + echo.close())
        if logs.error:
            out.write(f"\nwarning: {logs.error}\n")
        proc.stdout.close()


# ----------------------------------------------------------------------------- a failure's cause
_OWN_LINE = re.compile(r"^(?:\[[^\]]*\]:?\s*)?((?:config )?error: .+)$")  # the project's one-line errors
# an exception's line; `...Failed` as torch's BackendCompilerFailed (a failed compile)
_EXCEPTION = re.compile(r"^(?:\[[^\]]*\]:?\s*)?([A-Za-z_][\w.]*(?:Error|Exception|Interrupt|Failed)\b.*)$")
_LAUNCHER_NOISE = ("ChildFailedError", "torch.distributed.elastic", "SignalException")


_ROOT_CAUSE = "Root Cause (first observed failure):"
_FIELD = re.compile(r"^\s*(rank|exitcode)\s*:\s*(-?\d+)")
_RANK_PREFIX = re.compile(r"^\[rank(\d+)\]:")


def _root_cause(lines: list[str]) -> tuple[int, int] | None:
    """(rank, exit code) of torchrun's report of the first rank that failed (negative: a signal)."""
    at = max((i for i, line in enumerate(lines) if _ROOT_CAUSE in line), default=None)
    if at is None:
        return None
    found = dict(m.groups() for line in lines[at : at + 12] if (m := _FIELD.match(line)))
    if "rank" in found and "exitcode" in found:
        return int(found["rank"]), int(found["exitcode"])
    return None


def _rank_of(line: str) -> int:
    m = _RANK_PREFIX.match(line.strip())
    return int(m.group(1)) if m else 0  # rank 0 says its own lines without a prefix


_ENTRY = re.compile(r"^\[\d+\]:$")  # an entry of torchrun's failure report (one failed rank)
_RULE = re.compile(r"^(=|-){20,}$")


def _line_ranks(lines: list[str]) -> list[int]:
    """The rank each line is from: its `[rankN]:` prefix, else rank 0's, except in torchrun's
    failure report, whose entries quote each failed rank's error unprefixed: the entry's rank."""
    ranks, entry = [], None  # entry: the rank of the report entry being read
    for i, line in enumerate(lines):
        bare = line.strip()
        if _ENTRY.match(bare):
            found = (m.group(2) for s in lines[i + 1 : i + 6] if (m := _FIELD.match(s)) and m.group(1) == "rank")
            entry = int(next(found, "0"))
        elif _RULE.match(bare):
            entry = None
        ranks.append(entry if entry is not None else _rank_of(line))
    return ranks


_EXC_TYPE = re.compile(r"^(?:[A-Za-z_]\w*\.)*([A-Za-z_]\w*)(:.*)?$")  # Python's `module.Type: message` line


def _entry_error(lines: list[str]) -> str | None:
    """The exception the root cause's entry of torchrun's report ends with (the rank's error file:
    its traceback), in one line: `Type: message`, a message that ends in ':' joined with its next
    line (`BackendCompilerFailed: backend='inductor' raised: ImportError: ...`)."""
    at = max((i for i, line in enumerate(lines) if _ROOT_CAUSE in line), default=None)
    if at is None:
        return None
    entry: list[str] = []
    for line in lines[at + 1 :]:
        if _RULE.match(line.strip()):
            break
        entry.append(line)
    tb = next((i for i, line in enumerate(entry) if line.strip().startswith("traceback :")), None)
    if tb is None:
        return None
    body = [entry[tb].split("traceback :", 1)[1], *entry[tb + 1 :]]
    frames = [i for i, line in enumerate(body) if line.lstrip().startswith('File "')]
    if not frames:
        return None  # "To enable traceback see ...": torchrun had no error file of the rank
    indent = len(body[frames[-1]]) - len(body[frames[-1]].lstrip())
    said = [x.strip() for x in body[frames[-1] + 1 :] if x.strip() and len(x) - len(x.lstrip()) < indent]
    m = _EXC_TYPE.match(said[0]) if said else None
    if m is None:
        return None
    text = m.group(1) + (m.group(2) or "")
    return f"{text} {said[1]}" if text.endswith(":") and len(said) > 1 else text


def _launch_lines(log_path: Path, tail_bytes: int) -> list[str] | None:
    try:
        with open(log_path, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - tail_bytes))
            lines = f.read().decode(errors="replace").splitlines()
    except OSError:
        return None
    if any(line.startswith(SEPARATOR) for line in lines):  # only this launch's part of a reused log
        lines = lines[max(i for i, line in enumerate(lines) if line.startswith(SEPARATOR)) + 1 :]
    return lines


_KILLED = re.compile(r"^error: rank (\d+) \(pid \d+\) was killed by (\w+)")  # core/process.py RankDeaths


def _killed(rank: int, signame: str) -> str:
    hint = ": out of memory? it left no error of its own; see the log" if signame == "SIGKILL" else ""
    return f"rank {rank} was killed by {signame}{hint}"


def _first_killed(lines: list[str]) -> str | None:
    """A rank killed by a signal before any rank reported an error: the cause, whatever the
    survivors then said (a lost connection) or torchrun observed first."""
    for line in lines:
        if m := _KILLED.match(line.strip()):
            return _killed(int(m.group(1)), m.group(2))
        if _OWN_LINE.match(line.strip()) or _EXCEPTION.match(line.strip()):
            return None
    return None


def failure_cause(log_path: Path, tail_bytes: int = 1 << 20) -> str | None:
    """The line of a failed launch's log that says why, naming the rank that failed first: a rank
    killed by a signal (named by its agent), else torchrun's first observed failure with that
    rank's own `error: ...` line, else the exception it raised (its entry in torchrun's report,
    else its last exception line), else the signal that killed it; never a survivor's report of
    the lost connection."""
    lines = _launch_lines(log_path, tail_bytes)
    if lines is None:
        return None
    killed = _first_killed(lines)
    if killed:
        return killed
    root = _root_cause(lines)
    if root and root[1] < 0:
        return _killed(root[0], signal.Signals(-root[1]).name if -root[1] in set(signal.Signals) else str(-root[1]))
    ranks = _line_ranks(lines)
    own = [(r, line.strip()) for r, line in zip(ranks, lines, strict=True) if _OWN_LINE.match(line.strip())]
    if root and own and all(r != root[0] for r, _ in own):
        # torchrun observed first a rank that said no error of its own (a survivor failing on the
        # lost connection before the failed rank's exit was seen): the first rank that said one.
        return f"rank {own[0][0]}: {_OWN_LINE.match(own[0][1]).group(1)}"
    for pattern in (_OWN_LINE, _EXCEPTION):
        for r, line in reversed(list(zip(ranks, lines, strict=True))):
            m = pattern.match(line.strip())
            if not m or any(noise in line for noise in _LAUNCHER_NOISE):
                continue
            if root is None:
                return m.group(1)
            if r == root[0]:
                return f"rank {root[0]}: {m.group(1)}"
        if pattern is _OWN_LINE and root and (said := _entry_error(lines)):
            return f"rank {root[0]}: {said}"  # the exception the rank raised, as its error file has it
    return f"rank {root[0]} exited with code {root[1]}" if root else None
