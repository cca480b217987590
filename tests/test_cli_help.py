"""What a newcomer reads first from `run-recipe`: every command's line in `--help` whole,
`--version`, and `keys`: every config key with its default, allowed values and whole meaning."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from click.testing import CliRunner

from recipes.cli import main

pytestmark = pytest.mark.core

ROOT = Path(__file__).resolve().parents[1]


def invoke(*args):
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


def test_keys_lists_every_config_key_with_its_meaning():
    from core.config import field_docs

    res = invoke("keys")
    assert res.exit_code == 0, res.output
    docs = field_docs()
    assert all(doc for doc in docs.values()), [k for k, d in docs.items() if not d]
    for key in ("optimizer.lr", "parallelism.pp_schedule", "activation_checkpoint.mode"):
        assert key in res.output
    assert "peak learning rate" in invoke("keys", "optimizer.lr").output
    bad = invoke("keys", "no_such_key")
    assert bad.exit_code == 2 and "no config key contains" in bad.output


def _help_lines(output: str) -> dict[str, str]:
    """The Commands section of `--help`: command -> its line, wrapped lines joined."""
    lines: dict[str, list[str]] = {}
    for line in output.split("Commands:\n", 1)[1].splitlines():
        if line[2:3].strip():
            name, _, text = line.strip().partition(" ")
            lines[name] = [text]
        elif line.strip():
            lines[name].append(line)
    return {name: " ".join(" ".join(parts).split()) for name, parts in lines.items()}


def test_help_shows_every_commands_line_whole():
    from recipes.cli import EXTENSIONS

    res = invoke("--help")
    assert res.exit_code == 0, res.output
    shown = _help_lines(res.output)
    assert set(shown) == set(main.list_commands(None))
    cut = [name for name, text in shown.items() if text.endswith("...")]
    assert not cut, f"commands whose --help line is cut short: {cut}"
    for name, cmd in main.commands.items():  # the docstring's first paragraph, every word of it
        assert shown[name] == " ".join(cmd.help.split("\n\n")[0].split()), name
    for name, (_, line) in EXTENSIONS.items():
        assert shown[name] == line, name


def test_version_is_the_distributions_else_pyprojects(monkeypatch):
    import importlib.metadata

    import tomllib

    from recipes import cli

    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    try:
        installed = importlib.metadata.version(pyproject["name"])
    except importlib.metadata.PackageNotFoundError:
        installed = pyproject["version"]
    res = invoke("--version")
    assert res.exit_code == 0 and res.output == f"run-recipe {installed}\n"

    def not_installed(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", not_installed)
    assert cli.project_version() == pyproject["version"]


def _keys_table(output: str) -> dict[str, dict[str, str]]:
    """`run-recipe keys`' table read back: key -> {column: its text, wrapped lines joined}."""
    lines = output.splitlines()
    spans = [(m.start(), m.end()) for m in re.finditer(r"-+", lines[1])]
    headers = [lines[0][a:b].strip() for a, b in spans]
    rows: dict[str, dict[str, list[str]]] = {}
    for line in lines[2:]:
        cells = [line[a : b if i < len(spans) - 1 else None].strip() for i, (a, b) in enumerate(spans)]
        if cells[0]:
            key = cells[0]
        for h, c in zip(headers, cells, strict=True):
            rows.setdefault(key, {}).setdefault(h, []).append(c)
    return {k: {h: " ".join(p for p in parts if p) for h, parts in row.items()} for k, row in rows.items()}


def _words(text: str) -> str:
    return "".join(text.split())  # a wrapped cell may split a word at its hyphen


def test_keys_show_every_meaning_whole_and_the_allowed_values():
    from core.config import field_docs
    from core.models.args import FLAVORS

    res = invoke("keys")
    assert res.exit_code == 0, res.output
    from recipes.registry import CLI_OWNED_KEYS

    table = _keys_table(res.output)
    docs = {k: doc for k, doc in field_docs().items() if k not in CLI_OWNED_KEYS}  # set by --mode, the id, --out
    assert list(table) == list(docs)
    cut = [k for k, doc in docs.items() if _words(table[k]["meaning"]) != _words(doc)]
    assert not cut, f"keys whose meaning does not print whole: {cut}"
    assert _words(table["model.flavor"]["choices"]) == _words(", ".join(FLAVORS))
    for key, value in (("data.sharding", "global"), ("optimizer.implementation", "for-loop")):
        assert value in _words(table[key]["choices"]) and value in _words(table[key]["meaning"]), key
    assert table["optimizer.lr"]["choices"] == ""  # a free value lists none
