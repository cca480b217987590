"""The project's assets checked before anything spawns: the files a run will read against
`assets/MANIFEST.json` (missing, extra or changed: one line each, naming the file and the
command that rebuilds it) and the tokenizers' shape (ranks, vocabulary, special-token ids).
A user's own tokenizer or corpus (tokenizer.path / data.path pointing elsewhere) is not judged
here: the record names it by digest (core/provenance.py)."""

from __future__ import annotations

import hashlib
from pathlib import Path

from core.data.corpus import C4_OFFLINE_DIGEST
from core.data.shards import shard_folder
from core.data.store import (
    assets_root,
    c4_offline_path,
    file_sha256,
    llama3_tokenizer_path,
    proxy_tokenizer_path,
    read_manifest,
)
from core.data.tokenizer import LLAMA3_TOKENIZER_SHA256, NUM_SPECIAL_TOKENS, PROXY_TOKENIZER_SHA256
from core.errors import ConfigError

HUB_C4 = "allenai/c4"
# The project's assets: the command that rebuilds each, and the digest it must have on every
# machine (a tokenizer file's sha256; the corpus's `files_digest`).
REBUILD = {
    "llama3_tokenizer": "python -m core.data.assets --llama3-tokenizer",
    "proxy_tokenizer": "python -m core.data.assets --proxy-tokenizer",
    "c4_offline": "python -m core.data.assets --corpus",
}
PINNED = {
    "llama3_tokenizer": LLAMA3_TOKENIZER_SHA256,
    "proxy_tokenizer": PROXY_TOKENIZER_SHA256,
    "c4_offline": C4_OFFLINE_DIGEST,
}
TOKENIZER_RANKS = {"llama3_tokenizer": 128_000, "proxy_tokenizer": 4096}


def project_asset(path: str | Path | None, kind: str) -> str | None:
    """Which of the project's assets `path` is ("proxy_tokenizer", "llama3_tokenizer",
    "c4_offline"), or None: a user's own file or folder. kind: "tokenizer" or "corpus"."""
    if not path:
        return "c4_offline" if kind == "corpus" else None  # data.path unset: the offline corpus
    p = Path(path).resolve()
    if kind == "tokenizer":
        for name, where in (("proxy_tokenizer", proxy_tokenizer_path()), ("llama3_tokenizer", llama3_tokenizer_path())):
            if p == where.resolve():
                return name
        return None
    corpus = c4_offline_path().resolve()
    return "c4_offline" if p in (corpus, corpus / "en") else None


# Above this, a corpus is known by its shards' names and sizes: a local copy of C4 (1,024 shards,
# ~300 GB) cannot be hashed at every run's end; the project's corpus (5 MB) always is.
HASH_LIMIT_BYTES = 1 << 30


def corpus_files(path: str | Path | None) -> tuple[dict[str, str], str]:
    """({shard name: sha256} of every C4-layout shard of the corpus (train and validation), what
    the values are): "sha256", or "size" (bytes) for a corpus too large to hash."""
    shards = sorted(shard_folder(path).glob("c4-*.json.gz"))
    if sum(f.stat().st_size for f in shards) > HASH_LIMIT_BYTES:
        return {f.name: str(f.stat().st_size) for f in shards}, "size"
    return {f.name: file_sha256(f) for f in shards}, "sha256"


def files_digest(files: dict[str, str]) -> str:
    """One sha256 for a set of files: over their sorted `name sha256` lines."""
    return hashlib.sha256("".join(f"{n} {s}\n" for n, s in sorted(files.items())).encode()).hexdigest()


def manifest_problems(asset: str, folder_glob: tuple[Path, str] | None = None) -> list[str]:
    """Each file of `asset` that is missing or changed against assets/MANIFEST.json, and each
    file in `folder_glob` (folder, pattern) the manifest does not list: one line each."""
    root = assets_root(None)
    fix = f"rebuild it: {REBUILD[asset]}"
    manifest = root / "MANIFEST.json"
    listed = read_manifest(root).get("assets", {}).get(asset, {}).get("files") if manifest.is_file() else None
    if not listed:
        what = "is missing" if not manifest.is_file() else f"lists no {asset}"
        return [f"assets: {manifest} {what}; {fix} (or python -m core.data.assets --all)"]
    out = []
    for rel, sha in sorted(listed.items()):
        p = root / rel
        if not p.is_file():
            out.append(f"assets: {p} is missing (listed in {manifest}); {fix}")
        elif file_sha256(p) != sha:
            out.append(f"assets: {p} has changed since set-up (its sha256 is not {manifest}'s); {fix}")
    if folder_glob is not None:
        known = {(root / rel).resolve() for rel in listed}
        folder, pattern = folder_glob
        for p in sorted(folder.glob(pattern)):
            if p.resolve() not in known:
                out.append(f"assets: {p} is not one of {asset}'s files in {manifest} (an extra file); {fix}")
    return out


def tokenizer_shape_problems(asset: str, n_words: int, bos_id: int, eos_id: int) -> list[str]:
    """The project's tokenizer must have its ranks, then the 256 special tokens after them."""
    ranks = TOKENIZER_RANKS[asset]
    want = (ranks + NUM_SPECIAL_TOKENS, ranks, ranks + 1)
    if (n_words, bos_id, eos_id) == want:
        return []
    return [
        f"assets: the {asset.replace('_', ' ')} has {n_words} ids with BOS {bos_id} and EOS {eos_id}, "
        f"not {want[0]} with BOS {want[1]} and EOS {want[2]}; rebuild it: {REBUILD[asset]}"
    ]


def verify_assets(tokenizer_path: str | None, dataset: str, data_path: str | None) -> None:
    """ConfigError listing every problem of the project's assets that a run with these settings
    reads (nothing for a user's own files, nor for data streamed from the hub)."""
    problems: list[str] = []
    if dataset == "c4_offline" and project_asset(data_path, "corpus"):
        problems += manifest_problems("c4_offline", (shard_folder(data_path), "c4-*.json.gz"))
    tok = project_asset(tokenizer_path, "tokenizer") if dataset != "synthetic" else None
    if tok:
        problems += manifest_problems(tok)
        if not problems and tok == "llama3_tokenizer" and file_sha256(tokenizer_path) != PINNED[tok]:
            problems.append(f"assets: {tokenizer_path} is not Meta's Llama 3 tokenizer; rebuild it: {REBUILD[tok]}")
    if problems:
        raise ConfigError("\n".join(problems))
