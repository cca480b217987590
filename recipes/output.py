"""A launched process's output: echoed as it comes and kept in a log, or, for a multi-job launch
of core.train, split into each job's own log."""

from __future__ import annotations

import codecs
import os
import subprocess
import sys
from pathlib import Path

from core.config import JOB_MARKER


class JobLogs:
    """Where a launch's output goes: one log, or, for a multi-job launch, each job's own log from
    the JOB_MARKER line core.train prints before it (the marker lines are not echoed)."""

    def __init__(self, first: Path, by_output_dir: dict[str, Path] | None = None):
        self.by_output_dir = {str(Path(d).resolve()): log for d, log in (by_output_dir or {}).items()}
        self.file = open(first, "wb")  # noqa: SIM115 - switched at markers, closed by close()
        self.pending = ""  # a partial line that may still become a marker
        self.line_ended = True

    def write(self, text: str) -> str:
        """Log `text`; returns what to echo."""
        if not self.by_output_dir:
            self.file.write(text.encode())
            return text
        echo = []
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
            self.file.write(text.encode())
            echo.append(text)
            self.line_ended = text.endswith("\n")

    def _switch(self, output_dir: str) -> None:
        path = self.by_output_dir.get(str(Path(output_dir).resolve()))
        if path is not None and Path(self.file.name) != path:
            self.file.close()
            self.file = open(path, "wb")  # noqa: SIM115 - the next job's log, closed by close() or the next switch

    def close(self) -> str:
        rest, self.pending = self.pending, ""
        self.file.write(rest.encode())
        self.file.close()
        return rest


def stream(
    cmd: list[str], env: dict[str, str], log_path: Path, out=None, job_logs: dict[str, Path] | None = None
) -> int:
    """Run cmd, copying its merged stdout/stderr to `out` (default sys.stdout) and log_path as it
    comes (chunks, so progress bars are not held back until a newline). `job_logs` (output dir ->
    log) splits a multi-job launch's output per job, log_path taking what precedes the first."""
    out = out or sys.stdout
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    logs = JobLogs(log_path, job_logs)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
    try:
        fd = proc.stdout.fileno()
        while True:
            chunk = os.read(fd, 65536)
            if not chunk:
                break
            out.write(logs.write(decoder.decode(chunk)))
            out.flush()
        return proc.wait()
    except KeyboardInterrupt:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
        raise
    finally:
        out.write(logs.close())
        proc.stdout.close()
