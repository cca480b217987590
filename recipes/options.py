"""The options several `run-recipe` commands share, declared once: each takes the help line of the
command that uses it (what the folder or file is, and its default there)."""

from __future__ import annotations

import sys
import unicodedata
from pathlib import Path
from typing import NoReturn

import click

from core.fileio import check_writable_folder

# the rule `--set` values follow (core/overrides.py): no control, zero-width or line-separator character
from core.overrides import invisible_char


def control_char(text: str) -> str | None:
    """What makes `text` more than one line of visible text (None when it is not): a newline in a
    value written into a script is a live shell line there."""
    bad = invisible_char(text)
    if bad is None:
        return None
    i, ch = bad
    return f"U+{ord(ch):04X} ({unicodedata.name(ch, 'a control character')}) at position {i} of {text[:60]!r}"


def one_line(ctx: click.Context | None, param: click.Parameter | None, value):
    """click callback of every option (or argument) whose value reaches a script, a command line
    or a file name: refused (exit 2) while click parses, before anything is written."""
    for text in (value,) if isinstance(value, str) else value or ():
        bad = control_char(text)
        if bad:
            raise click.BadParameter(
                f"{bad}: a value that reaches a script, a command or a file name is one line of visible text"
            )
    return value


def out_dir_option(help: str, name: str = "out_dir"):
    """--out DIR: where a command writes its folders or files."""
    return click.option("--out", name, type=click.Path(file_okay=False), default=None, help=help, callback=one_line)


def out_file_option(help: str):
    """--out FILE: the one file a command writes."""
    return click.option("--out", type=click.Path(dir_okay=False), default=None, help=help, callback=one_line)


def records_dir_option(help: str):
    """--records-dir DIR: where result records are read or copied (<mode>/<id__>.json)."""
    return click.option("--records-dir", type=click.Path(file_okay=False), default=None, help=help, callback=one_line)


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


def text_option(name: str, metavar: str, help_text: str):
    """A click option taking one line of text (none by default), checked by `one_line`."""
    return click.option(name, default=None, metavar=metavar, callback=one_line, help=help_text)
