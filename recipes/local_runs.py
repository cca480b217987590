"""Rows run on this node by torchrun. Proxy rows of one world size share one torchrun (core.train's
multi-job launch): interpreter start-up, imports and the rendezvous are paid once per group, not per
row. Each row still gets its own run dir, `train.log`, `command.txt` and record. After a failed
launch, the row that failed is reported and the rows after it run again in a new launch.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import click

from recipes.output import stream

if TYPE_CHECKING:  # recipes/modes.py hands itself in: a type name only
    from recipes.modes import Row, RowMode


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
    for r in rows:
        (r.run_dir / "command.txt").write_text(" ".join(cmd) + "\n")
    click.echo("$ " + " ".join(cmd))
    logs = {r.cfg.job.output_dir: r.run_dir / "train.log" for r in rows} if len(rows) > 1 else None
    started = time.time()
    rc = stream(cmd, mode.env(rows[0].world), rows[0].run_dir / "train.log", job_logs=logs)
    return rc, started


def run_rows(rows: list[Row], mode: RowMode) -> list[str]:
    """Run every row (grouped where they can share a launch); copy each record to the mode's
    records folder. Returns the ids of the rows that failed."""
    failed = []
    pending = groups(rows, mode.shares_launch())
    while pending:
        group = pending.pop(0)
        for r in group:
            click.echo(mode.banner(r))
        if len(group) > 1:
            click.echo(f"-- these {len(group)} rows share one torchrun, one after another")
        rc, started = _launch(group, mode)
        for i, r in enumerate(group):
            result = r.run_dir / "result.json"
            fresh = result.is_file() and result.stat().st_mtime >= started  # not a previous run's record
            if fresh and (rc == 0 or i < len(group) - 1):  # a failed launch: its last row failed
                dest = mode.record(result, r.recipe, mode.options.records)
                click.echo(f"record: {result}" + (f" -> {dest}" if dest else ""))
                continue
            click.echo(f"FAILED: {r.recipe.id} (exit {rc}); log: {r.run_dir / 'train.log'}", err=True)
            failed.append(r.recipe.id)
            if group[i + 1 :]:  # the launch ended with this row: the rest get a launch of their own
                pending.insert(0, group[i + 1 :])
            break
    return failed
