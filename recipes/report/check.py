"""`run-recipe check [RECORD...]`: the compliance check of records (recipes/report/compliance.py),
one line a reason; exit 0 only when every record conforms."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import click

from recipes import options, paths
from recipes.report import compliance

EXIT_NOT_CONFORMING, EXIT_BAD_OPTION = 1, 2


@click.command("check")
@click.argument("records", nargs=-1, type=click.Path(dir_okay=False))
@options.records_dir_option("Check every record in it (<mode>/<id__>.json; default: results/records).")
def check_cmd(records, records_dir):
    """Whether each record is a conforming run of its row, and every reason why not.

    A record conforms when it holds today's fields, ran the row's configuration for its mode in
    full on the row's tokenizer and data, from a clean tree at a named commit on the pinned
    torch and torchao, with figures its peak allows (docs/results.md). Exit 0 only when all do."""
    t0 = time.perf_counter()
    if records:
        missing = [r for r in records if not Path(r).is_file()]
        if missing:
            options.refuse(f"error: no such record: {', '.join(missing)}")
        verdicts = [compliance.check_file(r) for r in records]
    else:
        folder = Path(records_dir) if records_dir else paths.default_records_dir()
        verdicts = compliance.check_folder(folder)
        if not verdicts:
            options.refuse(f"error: --records-dir {folder}: no record in it (<mode>/<id__>.json)")
    for v in verdicts:
        click.echo(f"{'ok  ' if v.conforms else 'FAIL'}  {paths.relative(v.path)}")
        for reason in v.reasons:
            click.echo(f"        {reason}")
    ok = sum(v.conforms for v in verdicts)
    click.echo(f"{ok} of {len(verdicts)} records conform ({time.perf_counter() - t0:.2f} s)")
    if ok < len(verdicts):
        sys.exit(EXIT_NOT_CONFORMING)
