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


# The versions this project pins (scripts/setup.sh installs torch first, pyproject.toml pins
# torchao): a record made with others is not a run of the suite as published.
PINNED = {"torch": "2.13.0", "torchao": "0.18.0"}


def base_version(version: str) -> str:
    """`2.13.0+cu128` -> `2.13.0`: the build's local tag (CPU, CUDA) names no other release."""
    return version.split("+", 1)[0]
