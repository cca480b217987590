"""The one way this project replaces a file: write a temporary file beside it, then rename it over
the old one (`os.replace` is atomic on one file system). A reader sees the old content or the new,
never half of either; a crash leaves at most a hidden `.<name>.<random>.tmp`, never a torn file.
The temporary name is unique (mkstemp), so concurrent writers of one file never collide on it.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

# The names atomic_path's temporary files take: `.<stem>.<mkstemp's random part>.tmp<suffix>`.
# Kept beside it so that what is made and what is cleaned (remove_leftovers) stay one pattern.
_TMP_MARK = ".tmp"
_LEFTOVER = re.compile(r"\..*\.[a-z0-9_]+" + re.escape(_TMP_MARK) + r"(\.[^.]*)?")


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike, fsync: bool = False) -> Iterator[Path]:
    """A temporary path beside `path` for a writer that wants a file name (csv, savefig, ...);
    renamed over `path` when the block ends without an exception, removed otherwise. `fsync`:
    flush the data to the disk before the rename (assets, checkpoints' own files)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=f".{path.stem}.", suffix=f"{_TMP_MARK}{path.suffix}", dir=path.parent)
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
        if fsync:
            with open(tmp, "rb") as f:
                os.fsync(f.fileno())
        os.chmod(tmp, 0o644)  # mkstemp makes it 0600; a replaced file reads as any other
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def is_leftover(name: str) -> bool:
    """Whether a file name is one atomic_path makes for its temporary file."""
    return _LEFTOVER.fullmatch(name) is not None


def remove_leftovers(folder: str | os.PathLike) -> list[Path]:
    """Remove the temporary files a killed writer left in `folder` (not below it); returns them.
    Only for a folder with one writer at a time (`run-recipe results`): another writer's file in
    flight would go too, and its rename fail."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    gone = [p for p in sorted(folder.iterdir()) if is_leftover(p.name) and not p.is_dir()]
    for p in gone:
        p.unlink(missing_ok=True)
    return gone


def atomic_write(path: str | os.PathLike, data: str | bytes, fsync: bool = False) -> Path:
    """Replace `path` with `data` (text is written as UTF-8)."""
    with atomic_path(path, fsync) as tmp:
        tmp.write_bytes(data.encode() if isinstance(data, str) else data)
    return Path(path)


def atomic_write_json(path: str | os.PathLike, obj, indent: int | None = 2, **dumps_kwargs) -> Path:
    """Replace `path` with `obj` as JSON and a final newline."""
    return atomic_write(path, json.dumps(obj, indent=indent, **dumps_kwargs) + "\n")


def atomic_copy(src: str | os.PathLike, dest: str | os.PathLike) -> Path:
    """Replace `dest` with a copy of `src`."""
    with atomic_path(dest) as tmp:
        shutil.copyfile(src, tmp)
    return Path(dest)


def check_writable_folder(folder: str | os.PathLike) -> None:
    """Raise OSError naming the place unless a file can be made in `folder`, or, where it does not
    exist yet, in the nearest folder above it (where it would be made). Checked before any work, so
    a read-only or misspelt output place is one line, not a traceback after the run. The probe is
    an unnamed file (O_TMPFILE where the system has it): nothing is left behind."""
    probe = Path(folder).absolute()
    while not probe.exists() and probe.parent != probe:
        probe = probe.parent
    if not probe.is_dir():
        raise NotADirectoryError(errno.ENOTDIR, "a file is in the way of the folder", str(probe))
    try:
        with tempfile.TemporaryFile(dir=probe):
            pass
    except OSError as e:
        raise OSError(e.errno, e.strerror, str(probe)) from None


def move_aside(path: str | os.PathLike, suffix: str) -> Path:
    """Rename `path` to `<path><suffix>` (one rename: a reader sees the file or its absence); a
    file another process moved first is fine. Returns the new path."""
    path = Path(path)
    aside = path.with_name(path.name + suffix)
    with contextlib.suppress(FileNotFoundError):
        os.replace(path, aside)
    return aside
