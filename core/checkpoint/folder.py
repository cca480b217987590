"""A checkpoint folder's layout, without torch: the one owner of its names and of what makes a
checkpoint complete. The Checkpointer (core/checkpoint/checkpointer.py) writes and loads through these; the
launcher reads a run's checkpoints through them before anything is spawned.

    <folder>/step-N/        a complete checkpoint: DCP shards, `.metadata`, `titan.json`, `manifest.json`
    <folder>/step-N.tmp/    being written, or left by a run killed mid-save: never loaded, removed at start
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from pathlib import Path

from core.logs import get_logger

log = get_logger(__name__)

STEP_RE = re.compile(r"^step-(\d+)$")
TMP = ".tmp"
INFO = "titan.json"
METADATA = ".metadata"
MANIFEST = "manifest.json"  # per-file sizes and CRC32s, written last (core/checkpoint/manifest.py)


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used; the message names the file."""


def step_dir(folder: str | os.PathLike, step: int) -> Path:
    """Where the complete checkpoint of `step` lives."""
    return Path(folder) / f"step-{step}"


def tmp_dir(folder: str | os.PathLike, step: int) -> Path:
    """Where the checkpoint of `step` is written before it is published."""
    return Path(folder) / f"step-{step}{TMP}"


def stale_tmp_dirs(folder: str | os.PathLike) -> list[Path]:
    """Half-written checkpoints (`step-N.tmp`) of a run killed mid-save."""
    folder = Path(folder)
    return sorted(folder.glob(f"step-*{TMP}")) if folder.is_dir() else []


def rename_complete(tmp: Path, final: Path) -> Path:
    """A checkpoint folder written in full under `tmp` takes its name (atomic: one rename)."""
    os.replace(tmp, final)
    return final


def publish(tmp: Path, folder: Path, step: int) -> Path:
    """Mark the checkpoint in `tmp` complete: rename it to `step-N`. A `step-N` already there (a
    damaged one, or a run that went back to an earlier step by another way) is moved aside and
    said, never deleted."""
    final = step_dir(folder, step)
    move_aside_if_damaged(final)
    if final.exists():
        aside = _aside(final, "replaced")
        os.replace(final, aside)
        log.warning(f"[checkpoint] {final} existed: moved to {aside} (kept) before the new save took its name")
    return rename_complete(tmp, final)


def _aside(path: Path, why: str) -> Path:
    """Where a checkpoint folder moved aside goes: beside it, a name no step reads."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    aside, n = path.with_name(f"{path.name}.{why}-{stamp}"), 1
    while aside.exists():
        aside, n = path.with_name(f"{path.name}.{why}-{stamp}-{n}"), n + 1
    return aside


def move_later_aside(folder: Path, step: int) -> list[Path]:
    """A run resumed from `step` (checkpoint.load_step into the past) will save the later steps
    again: their checkpoints, complete, incomplete or damaged, are renamed aside first (kept,
    never loaded again). Returns where they went."""
    later = {**complete_steps(folder), **incomplete_steps(folder)}
    moved = []
    for s in sorted(k for k in later if k > step):
        aside = _aside(later[s], "superseded")
        os.replace(later[s], aside)
        moved.append(aside)
    return moved


def purge(folder: Path, keep_latest_k: int) -> None:
    """keep_latest_k: drop the oldest complete checkpoints (the step-0 seed is kept)."""
    if keep_latest_k <= 0:
        return
    steps = [s for s in complete_steps(folder) if s > 0]
    for s in steps[:-keep_latest_k]:
        shutil.rmtree(step_dir(folder, s), ignore_errors=True)


def start_step(path: Path) -> int:
    """The step a run continues from after loading the checkpoint `path`: a full checkpoint's
    step from its titan.json (a weights-only one starts a run at 0)."""
    info = read_info(path)
    return int(info.get("step", 0)) if info.get("kind") == "full" else 0


def complete_steps(folder: str | os.PathLike) -> dict[int, Path]:
    """{step: path} of the complete checkpoints in `folder` (renamed and with DCP metadata)."""
    folder, out = Path(folder), {}
    if folder.is_dir():
        for p in folder.iterdir():
            m = STEP_RE.match(p.name)
            if m and p.is_dir() and (p / METADATA).is_file():
                out[int(m.group(1))] = p
    return dict(sorted(out.items()))


def incomplete_steps(folder: str | os.PathLike) -> dict[int, Path]:
    """{step: path} of `step-N` folders (renamed, so once complete) that lack DCP metadata."""
    folder, out = Path(folder), {}
    if folder.is_dir():
        for p in folder.iterdir():
            m = STEP_RE.match(p.name)
            if m and p.is_dir() and not (p / METADATA).is_file():
                out[int(m.group(1))] = p
    return dict(sorted(out.items()))


def folder_bytes(path: Path) -> int:
    """The bytes of a checkpoint folder's files (the space another save needs)."""
    return sum(f.stat().st_size for f in path.iterdir() if f.is_file())


def move_aside_if_damaged(final: Path) -> None:
    """A `step-N` without DCP metadata about to be replaced by a new save: kept aside, and said."""
    if final.exists() and not (final / METADATA).is_file():
        aside = final.with_name(f"{final.name}.damaged-{os.getpid()}")
        os.replace(final, aside)
        log.warning(f"[checkpoint] {final} had no {METADATA} (damaged); moved to {aside}")


def damaged_hint(path: Path, folder: Path) -> str:
    """How to go on without a damaged checkpoint: the previous complete step, if any."""
    older = [
        s
        for s in complete_steps(folder)
        if folder / f"step-{s}" != path and (not STEP_RE.match(path.name) or s < int(STEP_RE.match(path.name).group(1)))
    ]
    if not older:
        return f"no earlier complete checkpoint in {folder}; move {path.name} aside to start fresh"
    return (
        f"nothing was loaded or changed; to resume from step {older[-1]}, move it aside "
        f"(mv {path} {path}.damaged) or set checkpoint.load_step={older[-1]}"
    )


def is_checkpoint(path: str | os.PathLike) -> bool:
    return (Path(path) / METADATA).is_file()


def resolve(folder: Path, load_step: int = -1, resume_from: str = "") -> Path | None:
    """Which checkpoint a run loads: our own folder first (a restarted run continues from its
    own latest), then `resume_from` (a step folder, or a folder of them). None: start fresh."""
    own = complete_steps(folder)
    if load_step >= 0 and load_step in own:
        return own[load_step]
    newer = [p for s, p in incomplete_steps(folder).items() if load_step < 0 and s > max(own, default=-1)]
    if newer:  # never skipped (and later overwritten) without a word
        raise CheckpointError(
            f"{newer[-1] / METADATA}: missing: {newer[-1].name} is not a complete checkpoint "
            f"but newer than every complete one; {damaged_hint(newer[-1], folder)}"
        )
    if load_step < 0 and own:
        return own[max(own)]
    if resume_from:
        return resolve_source(Path(resume_from), load_step)
    if load_step >= 0:
        raise CheckpointError(
            f"{folder / f'step-{load_step}'}: checkpoint.load_step {load_step} not found "
            f"(complete checkpoints: {sorted(own) or 'none'})"
        )
    return None


def resolve_source(source: Path, load_step: int = -1) -> Path:
    """The checkpoint `checkpoint.resume_from` names: a step folder, or the latest (or
    `load_step`) of a folder of them."""
    if not source.exists():
        raise CheckpointError(f"{source}: checkpoint.resume_from does not exist")
    if is_checkpoint(source):
        return source
    steps = complete_steps(source)
    if not steps:
        raise CheckpointError(
            f"{source}: checkpoint.resume_from holds no complete checkpoint (no {METADATA}, no step-N/{METADATA})"
        )
    if load_step < 0:
        return steps[max(steps)]
    if load_step in steps:
        return steps[load_step]
    raise CheckpointError(
        f"{step_dir(source, load_step)}: checkpoint.load_step {load_step} not found "
        f"(complete checkpoints there: {sorted(steps)})"
    )


def read_info(path: Path) -> dict:
    f = path / INFO
    if not f.is_file():
        return {}
    try:
        info = json.loads(f.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError, OSError) as e:
        raise CheckpointError(f"{f}: corrupted checkpoint info ({e})") from None
    if not isinstance(info, dict) or not isinstance(info.get("model_shape", {}), dict):
        raise CheckpointError(f"{f}: corrupted checkpoint info (not the JSON object a checkpoint writes)")
    return info
