"""The project's own log lines. Every module of core/ logs through `get_logger(__name__)`; the
lines reach the terminal as plain text, as a user reads them: INFO on stdout, WARNING and above
on stderr, each line flushed (a rank's output is interleaved with the others' and with torchrun's).
Library loggers are left alone (core/noise.py drops the few known messages that are noise).
"""

from __future__ import annotations

import logging
import sys

ROOT = "titan"
PROGRESS_TTY_ENV = "TITAN_PROGRESS_TTY"  # "1"/"0": the launcher says whether its output is a terminal


class _PlainLines(logging.Handler):
    """`%(message)s` to the stream of the record's level, looked up when it is written (so a
    redirected or captured sys.stdout gets it)."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            stream = sys.stderr if record.levelno >= logging.WARNING else sys.stdout
            stream.write(self.format(record) + "\n")
            stream.flush()
        except Exception:  # noqa: BLE001 - logging's own contract: a failed write must not raise
            self.handleError(record)


def _root() -> logging.Logger:
    root = logging.getLogger(ROOT)
    if not any(isinstance(h, _PlainLines) for h in root.handlers):
        handler = _PlainLines()
        handler.setFormatter(logging.Formatter("%(message)s"))
        root.addHandler(handler)
        root.setLevel(logging.INFO)
        root.propagate = False  # a library's root-logger configuration does not print them twice
    return root


def get_logger(module: str) -> logging.Logger:
    """The logger of a module (`get_logger(__name__)`), under the project's root logger."""
    _root()
    return logging.getLogger(f"{ROOT}.{module}")
