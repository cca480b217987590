"""`run-recipe peer-bench`: our trainer and torchtitan's, side by side on this CPU.

Sets up (once) a venv with torchtitan 0.3.0 on the torch installed here, patched to run on a CPU
with gloo (recipes/peer_bench/patches.py lists each patch and why), with its assets built
locally. Then, per round and process count, runs ours and torchtitan's one right after the other
on the same shape (recipes/peer_bench/runs.py), appends a row per run to
results/peer_torchtitan.csv and prints the ratios. Timings on a shared machine move; the ratio of
two runs made back to back is the figure to read.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import click

from core.config import ConfigError, load_config
from core.validate import validate
from recipes.modes import EXIT_CANNOT, EXIT_CONFIG, EXIT_FAILED
from recipes.peer_bench import environment, runs


def _say(message: str) -> None:
    click.echo(f"[peer-bench] {message}")


def _fail(message: str, code: int) -> None:
    click.echo(f"error: {message}", err=True)
    sys.exit(code)


def _process_counts(ctx, param, values) -> tuple[int, ...]:
    """`--nproc 1 --nproc 2` or `--nproc 1,2`: distinct counts >= 1, in the order given."""
    counts: list[int] = []
    for value in values:
        for part in str(value).split(","):
            try:
                n = int(part)
            except ValueError:
                raise click.BadParameter(f"{part!r} is not a process count") from None
            if n < 1:
                raise click.BadParameter(f"{n}: a process count is at least 1")
            if n not in counts:
                counts.append(n)
    return tuple(counts)


def check_ours(steps: int, nprocs: tuple[int, ...], extra: tuple[str, ...]) -> None:
    """Our runs' configurations, validated for every process count before anything starts."""
    for n in nprocs:
        validate(load_config(None, runs.ours_overrides(steps, extra)), n, check_files=False)


@click.command("peer-bench")
@click.option(
    "--venv",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="The peer venv (created when missing). Default: .cache/peer_torchtitan/venv in the checkout.",
)
@click.option("--rounds", type=click.IntRange(min=1), default=3, show_default=True, help="Rounds of alternating runs.")
@click.option(
    "--steps",
    type=click.IntRange(min=runs.FIRST_STEADY),
    default=12,
    show_default=True,
    help=f"Steps per run; the figure is the mean over steps {runs.FIRST_STEADY}..STEPS.",
)
@click.option(
    "--nproc",
    "nprocs",
    multiple=True,
    default=("1", "2"),
    show_default=True,
    callback=_process_counts,
    help="Process counts to run (repeat, or 1,2).",
)
@click.option(
    "--ours-set",
    "ours_set",
    multiple=True,
    metavar="SECTION.KEY=VALUE",
    help="Extra override of our runs (repeatable), named in the CSV's trainer column.",
)
@click.option("--setup-only", is_flag=True, help="Set up the venv, patches and assets, then stop.")
def peer_bench(venv: Path | None, rounds: int, steps: int, nprocs: tuple[int, ...], ours_set, setup_only: bool):
    """Throughput against torchtitan 0.3.0 on this CPU (results/peer_torchtitan.csv)."""
    extra = tuple(ours_set)
    try:
        check_ours(steps, nprocs, extra)
    except ConfigError as e:
        _fail(f"--ours-set / our configuration: {e}", EXIT_CONFIG)
    venv = (venv or environment.default_venv()).resolve()
    try:
        environment.setup(venv, _say)
    except environment.IndexUnreachable as e:
        _fail(str(e), EXIT_CANNOT)
    except environment.SetupError as e:
        _fail(f"setup: {e}", EXIT_FAILED)
    if setup_only:
        _say("setup done (--setup-only)")
        return
    from core.metrics import cpu_model  # imports torch: only once runs are about to start

    measured = compare(venv, rounds, steps, nprocs, extra, cpu_model())
    summarize(measured)


def compare(venv: Path, rounds: int, steps: int, nprocs, extra, cpu: str) -> dict[int, list[tuple[float, float]]]:
    """Alternate ours and torchtitan's per round and process count; append each pair to the CSV
    as it is measured. Returns {nproc: [(ours, torchtitan), ...]}."""
    measured: dict[int, list[tuple[float, float]]] = {n: [] for n in nprocs}
    name = runs.ours_name(extra)
    path = runs.csv_path()
    for rnd in range(1, rounds + 1):
        for n in nprocs:
            _say(f"round {rnd}/{rounds}, {n} process(es): ours ...")
            try:
                ours = runs.run_ours(n, steps, extra)
                _say(f"round {rnd}/{rounds}, {n} process(es): torchtitan ...")
                peer = runs.run_torchtitan(venv, n, steps, f"{time.strftime('%Y%m%d-%H%M%S')}-n{n}-r{rnd}")
            except (RuntimeError, ValueError) as e:
                _fail(str(e), EXIT_FAILED)
            now = runs.utc_now()
            runs.append_rows(
                path, [_row(now, cpu, name, n, rnd, steps, ours), _row(now, cpu, runs.PEER_NAME, n, rnd, steps, peer)]
            )
            measured[n].append((ours, peer))
            _say(
                f"round {rnd}, {n} process(es): ours {ours:.0f}, torchtitan {peer:.0f} tokens/s/rank, "
                f"ratio {ours / peer:.3f}"
            )
    _say(f"appended {2 * rounds * len(nprocs)} rows to {path}")
    return measured


def _row(date: str, cpu: str, trainer: str, nproc: int, rnd: int, steps: int, tps: float) -> dict:
    return {
        "date": date,
        "cpu": cpu,
        "trainer": trainer,
        "nproc": nproc,
        "round": rnd,
        "steps": steps,
        "tokens_per_s_per_rank": round(tps),
    }


def summarize(measured: dict[int, list[tuple[float, float]]]) -> None:
    for n, pairs in measured.items():
        ratios = [o / p for o, p in pairs]
        _say(
            f"{n} process(es): ours/torchtitan per round {', '.join(f'{r:.3f}' for r in ratios)}; "
            f"median {statistics.median(ratios):.3f}"
        )
