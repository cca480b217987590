"""What a newcomer reads first from `run-recipe`: `keys`, every config key with its default,
allowed values and whole meaning."""

from __future__ import annotations

import re

import pytest
from click.testing import CliRunner

from recipes.cli import main

pytestmark = pytest.mark.core


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
    table, docs = _keys_table(res.output), field_docs()
    assert list(table) == list(docs)
    cut = [k for k, doc in docs.items() if _words(table[k]["meaning"]) != _words(doc)]
    assert not cut, f"keys whose meaning does not print whole: {cut}"
    assert _words(table["model.flavor"]["choices"]) == _words(", ".join(FLAVORS))
    for key, value in (("data.sharding", "global"), ("optimizer.implementation", "for-loop")):
        assert value in _words(table[key]["choices"]) and value in _words(table[key]["meaning"]), key
    assert table["optimizer.lr"]["choices"] == ""  # a free value lists none
