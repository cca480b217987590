"""The committed version of a generated file, for tests that check what the harness wrote: the
README's main job and every `run-recipe` command rewrite results/ on the machine they run on, so
a test reads results/ as committed (git's HEAD), never as the last command left it. Outside a
git checkout (an unpacked archive) the working tree is what was shipped."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _git(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, check=False)


def in_git() -> bool:
    return shutil.which("git") is not None and _git("rev-parse", "--verify", "HEAD").returncode == 0


def committed_bytes(rel: str) -> bytes:
    """`rel` (relative to the checkout) as committed at HEAD."""
    if in_git():
        shown = _git("show", f"HEAD:{rel}")
        if shown.returncode == 0:
            return shown.stdout
    return (ROOT / rel).read_bytes()


def committed_names(rel_dir: str, pattern: str = "*") -> list[str]:
    """The files of `rel_dir` (relative paths) committed at HEAD that match the glob `pattern`."""
    if in_git():
        listed = _git("ls-tree", "--name-only", "HEAD", f"{rel_dir.rstrip('/')}/")
        names = [n for n in listed.stdout.decode().splitlines() if n]
    else:
        names = [str(p.relative_to(ROOT)) for p in (ROOT / rel_dir).iterdir() if p.is_file()]
    return sorted(n for n in names if Path(n).match(pattern))


def copy_committed(rel: str, dest: Path) -> Path:
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_bytes(committed_bytes(rel))
    return dest


def copy_committed_tree(rel_dir: str, dest: Path) -> Path:
    """Every file committed under `rel_dir` (one level of sub-folders, as results/records/<mode>/)
    copied below `dest`, keeping their paths relative to `rel_dir`."""
    for sub in [rel_dir.rstrip("/")] + [f"{rel_dir.rstrip('/')}/{m}" for m in ("real", "proxy", "dry-run")]:
        for rel in committed_names(sub):
            if (ROOT / rel).is_dir() or not Path(rel).suffix:
                continue
            copy_committed(rel, dest / Path(rel).relative_to(rel_dir))
    return dest
