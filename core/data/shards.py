"""The shards of a corpus in C4's layout (`<folder>/en/c4-<split>.NNNNN-of-NNNNN.json.gz`), found
and checked without reading them whole and without torch: the pre-launch check and the loader
both ask here."""

from __future__ import annotations

import gzip
import os
from pathlib import Path

from core.data.store import c4_offline_path

CORPUS_SETUP = "python -m core.data.assets --corpus"
GZIP_MAGIC = b"\x1f\x8b"


class CorpusError(ValueError):
    """A corpus the run cannot read: the message names the folder or file, and what is wrong."""


class CorpusNotFoundError(CorpusError, FileNotFoundError):
    """No corpus where data.path points: no folder, or no shards of the split in it."""


def shard_folder(path: str | os.PathLike | None) -> Path:
    root = Path(path) if path else c4_offline_path()
    return root / "en" if (root / "en").is_dir() else root


def c4_shards(path: str | os.PathLike | None, split: str = "train") -> list[Path]:
    """The split's shards, sorted (CorpusError when there are none)."""
    folder = shard_folder(path)
    if not folder.is_dir():
        what = "does not exist" if not folder.exists() else "is not a folder"
        raise CorpusNotFoundError(f"data.path: {folder} {what} (build the offline corpus: {CORPUS_SETUP})")
    files = sorted(folder.glob(f"c4-{split}.*.json.gz"))
    if not files:
        raise CorpusNotFoundError(
            f"data.path: {folder} has no c4-{split}.*.json.gz shards (build the offline corpus: {CORPUS_SETUP}, "
            f"or point data.path at a folder that holds them)"
        )
    return files


def check_corpus(path: str | os.PathLike | None, split: str = "train") -> None:
    """What can be known before any rank reads: the shards exist, can be opened, are gzip and
    hold a first line (one block each: a truncated end is found where it is read, naming the
    line). The launcher (or a job's rank 0) checks, once: not every rank."""
    for f in c4_shards(path, split):
        try:
            with open(f, "rb") as fh:
                head = fh.read(2)
        except OSError as e:
            raise CorpusError(f"data.path: {f}: cannot be read ({e.strerror or e})") from None
        if head != GZIP_MAGIC:
            what = "is empty" if not head else "is not a gzip file"
            raise CorpusError(f"data.path: {f} {what}")
        try:  # its first line: a gzip stream of nothing is a shard without a document
            with gzip.open(f, "rb") as g:
                first = g.readline()
        except (OSError, EOFError) as e:
            raise CorpusError(f"data.path: {f}: its gzip stream cannot be read ({e})") from None
        if not first.strip():
            raise CorpusError(f"data.path: {f} holds no document (an empty gzip stream)")
