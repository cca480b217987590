"""Checkpoint overhead: how long the training loop is blocked by a synchronous DCP save vs an
asynchronous one of the same proxy state (the paper: async DCP cuts the overhead 5-15x).

For each checkpoint.async_mode the real trainer runs a few steps in this process, saving every
`interval` steps; the figures are medians of the Checkpointer's own timings over the saves made
during training. Left out: the first save (one-time costs: the background process of the pinned mode
is spawned, staging buffers are allocated) and the final save (always synchronous):

    blocking_s  time the training thread spent in checkpoint code for one save (state dict,
                copy to CPU memory, waiting for a background copy before the next optimizer
                step, waiting for the previous upload before a new save)
    total_s     from the start of the save until the checkpoint is complete on disk

The default interval (5 steps of the debug flavor) leaves time for an upload to finish before
the next save; with a shorter one the loop also waits for the previous upload (reported as
`wait` and included in blocking_s).

    run-recipe checkpoint-bench [--out results/checkpoint_overhead.csv] [--flavor debug]
"""

from __future__ import annotations

import os
import statistics
import tempfile
from pathlib import Path

import click

from core.config import load_config
from core.train import Trainer
from core.validate import validate
from recipes import paths
from recipes.options import out_file_option
from recipes.report.results import write_csv
from recipes.studies.common import one_rank_group, synthetic_job

MODES = ("disabled", "async", "async_with_pinned_mem")
COLUMNS = ("mode", "blocking_s", "total_s")


def measure(
    mode: str,
    out_dir: str | os.PathLike,
    flavor: str = "debug",
    steps: int = 26,
    interval: int = 5,
    seq_len: int = 64,
    local_batch_size: int = 4,
) -> dict:
    """Train `steps` steps with checkpoint.async_mode=mode; median timings of the in-loop saves."""
    cfg = validate(
        load_config(
            None,
            synthetic_job(
                flavor,
                seq_len,
                local_batch_size,
                steps,
                f"--job.output_dir={out_dir}",
                "--checkpoint.enabled=true",
                f"--checkpoint.interval={interval}",
                f"--checkpoint.async_mode={mode}",
            ),
        ),
        1,
        check_files=False,
    )
    trainer = Trainer(cfg)
    trainer.train()
    stats = trainer.checkpointer.stats
    saves = [s for s in stats[1:] if s["step"] != steps]
    if not saves:
        raise ValueError(f"steps {steps} with interval {interval}: no in-loop save after the first")

    def med(key: str) -> float:  # shared CPUs: medians
        return statistics.median(s[key] for s in saves)

    return {
        "mode": "sync" if mode == "disabled" else mode,
        "blocking_s": med("blocking_s"),
        "total_s": med("total_s"),
        "wait_s": med("wait_s"),
        "saves": len(saves),
        "first_blocking_s": stats[0]["blocking_s"],
    }


def default_csv() -> Path:
    return paths.results_root() / "checkpoint_overhead.csv"


def run_checkpoint_bench(
    out_csv: str | os.PathLike | None = None,
    flavor: str = "debug",
    steps: int = 26,
    interval: int = 5,
    work_dir: str | os.PathLike | None = None,
) -> list[dict]:
    """Measure every mode and write `out_csv` (columns mode, blocking_s, total_s). Runs in this
    process, in the world-1 group it finds or creates (one group for all modes: the pinned
    mode's background save process is bound to it)."""
    rows = []
    with one_rank_group(), tempfile.TemporaryDirectory(dir=work_dir) as tmp:
        for mode in MODES:
            rows.append(measure(mode, Path(tmp) / mode, flavor, steps, interval))
    write_csv(
        out_csv or default_csv(),
        [{"mode": r["mode"], "blocking_s": f"{r['blocking_s']:.4f}", "total_s": f"{r['total_s']:.4f}"} for r in rows],
        COLUMNS,
    )
    return rows


def benchmark_rows(quick: bool = False) -> list[dict]:
    """Checkpoint overhead: sync vs async DCP save (results/checkpoint_overhead.csv)"""
    shape = {"flavor": "tiny", "steps": 5, "interval": 1} if quick else {"flavor": "debug", "steps": 26, "interval": 5}
    rows = run_checkpoint_bench(default_csv(), **shape)
    sync = rows[0]
    out = []
    for r in rows[1:]:
        out.append(
            {
                "benchmark": f"checkpoint_blocking_sync_over_{r['mode']}",
                "value": f"{sync['blocking_s'] / r['blocking_s']:.1f}",
                "unit": "ratio",
                "notes": f"loop blocked {sync['blocking_s']:.3f} s (sync) vs {r['blocking_s']:.3f} s per save; "
                f"{shape['flavor']} flavor, world 1, median of {r['saves']} saves; goal >= 5 "
                "(paper: 5-15x)",
            }
        )
    return out


@click.command("checkpoint-bench")
@out_file_option("The CSV (default: results/checkpoint_overhead.csv).")
@click.option("--flavor", default="debug", show_default=True)
@click.option("--steps", type=int, default=26, show_default=True)
@click.option("--interval", type=int, default=5, show_default=True)
def checkpoint_bench(out, flavor, steps, interval):
    """Checkpoint overhead: training-loop time blocked by a sync vs an async DCP save."""
    out = Path(out) if out else default_csv()
    rows = run_checkpoint_bench(out, flavor, steps, interval)
    sync = rows[0]["blocking_s"]
    for r in rows:
        click.echo(
            f"{r['mode']:>22}: blocks {r['blocking_s']:.3f} s per save ({sync / r['blocking_s']:.1f}x less "
            f"than sync; {r['wait_s']:.3f} s of it waiting for the previous upload), complete after "
            f"{r['total_s']:.3f} s  [{r['saves']} saves; the first save blocked {r['first_blocking_s']:.3f} s]"
        )
    click.echo(f"-> {out}")
