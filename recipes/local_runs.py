"""Rows run on this node by torchrun. Proxy rows of one world size share one torchrun (core.train's
multi-job launch): interpreter start-up, imports and the rendezvous are paid once per group, not per
row. Each row still gets its own run dir, `train.log`, `command.txt` and record. After a failed
launch, the row that failed is reported and the rows after it run again in a new launch.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import click

from core.config import JobConfig
from recipes import launcher
from recipes.output import stream
from recipes.schema import Recipe


@dataclass
class LocalRow:
    recipe: Recipe
    cfg: JobConfig
    world: int
    run_dir: Path
    job: Path  # the job config written into run_dir


def groups(rows: list[LocalRow], mode: str, max_restarts: int) -> list[list[LocalRow]]:
    """Consecutive rows that can share a launch: proxy mode, no restarts (a restart resumes one
    job), one world size and one [comm] (the process group's settings)."""
    out: list[list[LocalRow]] = []
    for row in rows:
        last = out[-1][-1] if out else None
        if (
            mode == "proxy"
            and not max_restarts
            and last is not None
            and (last.world, last.cfg.comm) == (row.world, row.cfg.comm)
        ):
            out[-1].append(row)
        else:
            out.append([row])
    return out


def _launch(rows: list[LocalRow], mode: str, max_restarts: int) -> tuple[int, float]:
    cmd = launcher.local_command(rows[0].world, [r.job for r in rows], max_restarts, mode)
    for r in rows:
        (r.run_dir / "command.txt").write_text(" ".join(cmd) + "\n")
    click.echo("$ " + " ".join(cmd))
    logs = {r.cfg.job.output_dir: r.run_dir / "train.log" for r in rows} if len(rows) > 1 else None
    started = time.time()
    rc = stream(cmd, launcher.launch_env(mode, rows[0].world), rows[0].run_dir / "train.log", job_logs=logs)
    return rc, started


def run_rows(rows: list[LocalRow], mode: str, max_restarts: int, records: Path | None) -> list[str]:
    """Run every row (grouped where they can share a launch); copy each record to `records`.
    Returns the ids of the rows that failed."""
    failed = []
    pending = groups(rows, mode, max_restarts)
    while pending:
        group = pending.pop(0)
        for r in group:
            click.echo(f"== {r.recipe.id} · {mode} · world {r.world} · {r.run_dir}")
        if len(group) > 1:
            click.echo(f"-- these {len(group)} rows share one torchrun, one after another")
        rc, started = _launch(group, mode, max_restarts)
        for i, r in enumerate(group):
            result = r.run_dir / "result.json"
            fresh = result.is_file() and result.stat().st_mtime >= started  # not a previous run's record
            if fresh and (rc == 0 or i < len(group) - 1):  # a failed launch: its last row failed
                dest = launcher.copy_record(result, records, mode, r.recipe)
                click.echo(f"record: {result}" + (f" -> {dest}" if dest else ""))
                continue
            click.echo(f"FAILED: {r.recipe.id} (exit {rc}); log: {r.run_dir / 'train.log'}", err=True)
            failed.append(r.recipe.id)
            if group[i + 1 :]:  # the launch ended with this row: the rest get a launch of their own
                pending.insert(0, group[i + 1 :])
            break
    return failed
