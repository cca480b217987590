"""The installed version of a distribution, read from its metadata (no import of the package:
torchao, for one, is heavy and only Float8 runs import it)."""

from __future__ import annotations

from importlib import metadata


def installed_version(distribution: str) -> str | None:
    """The installed version of `distribution`, or None where it is not installed."""
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None
