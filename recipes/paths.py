"""Where the harness reads and writes: the checkout holding the recipes, its runs/ and results/.
Every table, figure, golden file and study output goes under results/ (or a folder the user
names), never relative to the working directory."""

from __future__ import annotations

from pathlib import Path

PACKAGE_ROOT = Path(__file__).resolve().parents[1]


def project_root() -> Path:
    """The source checkout holding the recipes (editable install), else the working directory."""
    return PACKAGE_ROOT if (PACKAGE_ROOT / "pyproject.toml").is_file() else Path.cwd()


def default_runs_dir() -> Path:
    return project_root() / "runs"


def results_root() -> Path:
    """`results/` of the checkout."""
    return project_root() / "results"


def default_records_dir() -> Path:
    return results_root() / "records"


def relative(path: str | Path, start: str | Path | None = None) -> str:
    """path relative to start (default: the project root) when inside it, else as given."""
    try:
        return str(Path(path).relative_to(start or project_root()))
    except ValueError:
        return str(path)
