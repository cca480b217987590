"""What a record was made from, written into the record itself: the code (the commit, and whether
the tree held changes not committed), a fingerprint of the resolved configuration, and the
identity of the tokenizer and data the run read (the sha256 of each file, or a hub data set's
name and revision). `run-recipe check` (recipes/report/compliance.py) judges records by them, as
MLPerf's compliance checker judges a log: a number counts when its record proves what it ran."""

from __future__ import annotations

import hashlib
import json
import subprocess
from pathlib import Path

from core.config import JobConfig, flatten_keys
from core.data.store import file_sha256
from core.data.verify import HUB_C4, corpus_files, files_digest, project_asset

# Keys that say where a run lives, not what it computes: left out of the fingerprint and of the
# deviations (the asset paths are judged by the files' digests instead).
RUN_LOCAL_KEYS = ("job.output_dir", "job.deviations", "tokenizer.path", "data.path")
# What a checkout's code and rows are: a change here changes what runs (results/ is generated).
CODE_PATHS = ("core", "recipes", "llama3_8b", "llama3_70b", "llama3_405b", "long_context", "pyproject.toml")


def git_state(root: Path | None = None) -> dict:
    """{"git": HEAD's short hash ("" outside a checkout), "git_dirty": whether tracked files
    outside results/ differ from it or the code has untracked files (None: unknown)}."""
    root = root or Path(__file__).resolve().parents[1]
    git = ["git", "-C", str(root)]
    try:
        head = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=5)
        tracked = subprocess.run(
            [*git, "status", "--porcelain", "--untracked-files=no", "--", ".", ":(exclude)results"],
            capture_output=True,
            text=True,
            timeout=5,
        )
        untracked = subprocess.run(
            [*git, "ls-files", "--others", "--exclude-standard", "--", *CODE_PATHS],
            capture_output=True,
            text=True,
            timeout=5,
        )
    except (OSError, subprocess.TimeoutExpired):
        return {"git": "", "git_dirty": None}
    commit = head.stdout.strip() if head.returncode == 0 else ""
    if not commit or tracked.returncode or untracked.returncode:
        return {"git": commit, "git_dirty": None}
    return {"git": commit, "git_dirty": bool(tracked.stdout.strip() or untracked.stdout.strip())}


def config_fingerprint(config: dict) -> str:
    """sha256 (16 hex digits) of the resolved configuration, its run-local keys left out: two
    runs of one row in one mode with the same settings share it, wherever they ran."""
    flat = {k: v for k, v in flatten_keys(config).items() if k not in RUN_LOCAL_KEYS}
    return hashlib.sha256(json.dumps(flat, sort_keys=True, default=str).encode()).hexdigest()[:16]


def asset_identity(cfg: JobConfig) -> dict:
    """The tokenizer and data a run reads, by content: {"tokenizer": {...}, "data": {...}}. A
    project asset is named (`asset`); a user's own file has asset None and is known by digest."""
    d = cfg.data
    data: dict = {"dataset": d.dataset}
    if d.dataset == "c4_offline":
        files, kind = corpus_files(d.path)
        data.update(asset=project_asset(d.path, "corpus"), digest=files_digest(files), files=files, files_by=kind)
    elif d.dataset == "c4":
        # streamed from the hub's main branch: its name and revision are the identity
        data.update(name=HUB_C4, config="en", revision="main")
    out = {"data": data}
    if d.dataset != "synthetic":
        t = Path(cfg.tokenizer.path)
        out["tokenizer"] = {"asset": project_asset(t, "tokenizer"), "sha256": file_sha256(t) if t.is_file() else None}
    return out


def provenance(cfg: JobConfig, read_assets: bool = True) -> dict:
    """The record's `provenance`: the configuration's fingerprint, the keys where the job differs
    from its row (None: not a recipe row), and the assets it read (a dry-run reads none)."""
    return {
        "config_fingerprint": config_fingerprint(cfg.to_dict()),
        "deviations": list(cfg.job.deviations) if cfg.job.recipe else None,
        "assets": asset_identity(cfg) if read_assets else None,
    }
