"""The options several `run-recipe` commands share, declared once: each takes the help line of the
command that uses it (what the folder or file is, and its default there)."""

from __future__ import annotations

import click


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
