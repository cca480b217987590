"""The options several `run-recipe` commands share, declared once: each takes the help line of the
command that uses it (what the folder or file is, and its default there)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import NoReturn

import click

from core.fileio import check_writable_folder


def out_dir_option(help: str, name: str = "out_dir"):
    """--out DIR: where a command writes its folders or files."""
    return click.option("--out", name, type=click.Path(file_okay=False), default=None, help=help)


def out_file_option(help: str):
    """--out FILE: the one file a command writes."""
    return click.option("--out", type=click.Path(dir_okay=False), default=None, help=help)


def records_dir_option(help: str):
    """--records-dir DIR: where result records are read or copied (<mode>/<id__>.json)."""
    return click.option("--records-dir", type=click.Path(file_okay=False), default=None, help=help)


def overrides_option(help: str):
    """--set SECTION.KEY=VALUE, repeatable (`run-recipe keys` lists the keys)."""
    return click.option("--set", "overrides", multiple=True, metavar="SECTION.KEY=VALUE", help=help)


EXIT_BAD_OPTION = 2  # as `run-recipe`'s: a bad option, nothing was done


def refuse(message: str) -> NoReturn:
    """One line on stderr and exit 2: a bad option, found before any work."""
    click.echo(message, err=True)
    sys.exit(EXIT_BAD_OPTION)


def check_writable(option: str, folder: str | Path) -> None:
    """Refuse (one line, exit 2) unless `folder`, named by `option`, can be written (or made),
    before any work that would write there."""
    try:
        check_writable_folder(folder)
    except OSError as e:
        refuse(f"error: {option} {folder}: cannot write in {e.filename}: {e.strerror}")
