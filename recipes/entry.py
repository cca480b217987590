"""`run-recipe`'s entry point: signals are heard from the first instant. The CLI's imports (torch
among them) take seconds; a Ctrl-C, SIGTERM or SIGHUP then stops the command with one line and the
shell's exit code, as one does later (recipes/output.py `stop_on_signals`), not with a traceback
from the middle of an import. SIGINT is heard even when inherited ignored (a launcher started in
the background of a script); SIGHUP ignored on purpose (nohup) stays ignored."""

from __future__ import annotations

import os
import signal
import sys

START_UP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def _stopped_during_start_up(signum, frame) -> None:
    sys.stderr.write(f"\nstopped by {signal.Signals(signum).name}: during start-up, nothing was running\n")
    sys.stderr.flush()
    os._exit(128 + signum)  # nothing to clean up yet, and an import may be half done


def hear_signals_from_start() -> dict:
    """Stop on the signals while the CLI imports; returns the handlers they replaced."""
    previous = {}
    for signum in START_UP_SIGNALS:
        if signum == signal.SIGHUP and signal.getsignal(signum) == signal.SIG_IGN:
            continue
        previous[signum] = signal.signal(signum, _stopped_during_start_up)
    return previous


def after_start_up(previous: dict) -> None:
    """The imports done: the handlers come back, SIGINT as Python's own (KeyboardInterrupt, so that
    cleanups run) even if it was inherited ignored."""
    for signum, handler in previous.items():
        signal.signal(signum, signal.default_int_handler if signum == signal.SIGINT else handler)


def main() -> None:
    previous = hear_signals_from_start()
    from recipes.cli import main as cli_main

    after_start_up(previous)
    cli_main()


if __name__ == "__main__":
    main()
