"""`--set section.key=value` (and the trainer's `--section.key=value`): one line of visible text,
read as a TOML literal. Refused, naming the key, with the value cut short in the message: control,
zero-width and line-separator characters, values over a path's length, integers beyond 64 bits."""

from __future__ import annotations

import unicodedata
from typing import Any

import tomllib

from core.errors import ConfigError

# An override is one line of visible text: a value longer than a path can be, or an integer
# beyond TOML's 64 bits, is a mistake (or an attack on the parser), refused naming the key.
MAX_OVERRIDE_CHARS = 4096
MAX_OVERRIDE_INT = 2**63 - 1


def _cut(text: str, n: int = 60) -> str:
    """A value as a message shows it: quoted, control characters escaped, at most n characters."""
    shown = repr(text[:n])
    return shown + (f" ... ({len(text):,} characters)" if len(text) > n else "")


def invisible_char(text: str) -> tuple[int, str] | None:
    """(index, character) of the first control, format (zero-width) or line-separator character."""
    for i, ch in enumerate(text):
        if unicodedata.category(ch) in ("Cc", "Cf", "Zl", "Zp"):
            return i, ch
    return None


def _check_override_text(dotted: str, raw: str) -> None:
    bad = invisible_char(dotted)
    if bad:
        i, ch = bad
        raise ConfigError(
            f"{_cut(dotted)}: the key holds an invisible character U+{ord(ch):04X} "
            f"({unicodedata.name(ch, 'control')}) at position {i}: type it again"
        )
    bad = invisible_char(raw)
    if bad:
        i, ch = bad
        raise ConfigError(
            f"{dotted}: the value holds U+{ord(ch):04X} ({unicodedata.name(ch, 'a control character')}) at "
            f"position {i}: an override is one line of visible text (got {_cut(raw)})"
        )
    if len(raw) > MAX_OVERRIDE_CHARS:
        raise ConfigError(
            f"{dotted}: the value is {len(raw):,} characters, over {MAX_OVERRIDE_CHARS:,} (got {_cut(raw)})"
        )


def parse_override(text: str) -> tuple[str, str, Any]:
    """'section.key=value' (a leading '--' is allowed) -> (section, key, value).

    The value is read as a TOML literal (numbers, booleans, quoted strings, lists); anything
    that is not a valid literal is taken as a bare string. One line of visible text only.
    """
    body = text.removeprefix("--")
    if "=" not in body:
        raise ConfigError(f"{_cut(text)}: an override must look like section.key=value")
    dotted, raw = body.split("=", 1)
    _check_override_text(dotted, raw)
    if dotted.count(".") != 1:
        raise ConfigError(f"{_cut(dotted)}: an override key must be section.key")
    section, key = (part.strip() for part in dotted.split("."))  # `training.steps = 5` as TOML reads it
    dotted = f"{section}.{key}"
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except (tomllib.TOMLDecodeError, ValueError):  # ValueError: Python's limit on int digits
        value = raw = raw.strip()
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) > MAX_OVERRIDE_INT:
        raise ConfigError(f"{dotted}: {_cut(raw)} is beyond a 64-bit integer")
    if isinstance(value, str) and value == raw and raw.strip().lstrip("+-").isdigit():
        raise ConfigError(f"{dotted}: {_cut(raw)} is not an integer TOML can read (too many digits)")
    return section, key, value
