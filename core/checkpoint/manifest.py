"""A checkpoint's manifest (`MANIFEST`): every file's size and CRC32, written last, checked before
a load. No rank reads the whole checkpoint: the work is split by rank (the collectives that join
the parts are core/checkpoint/collectives.py). This module is torch-free.

Save: each rank checksums the files it wrote. DCP's FileSystemWriter (torch 2.13, one file per
rank and I/O thread) names them `__<R>_<n>.distcp`, R being the rank's place in the save's process
group (`prepare_global_plan` hands plan i the prefix `__i_`); its coordinator, rank 0, writes
`.metadata`. Rank 0 gathers the per-rank results and writes the manifest, checksumming itself
only a file no rank claimed (none with torch 2.13's writer). `titan.json` stays out of it (ours,
checked as it is parsed).

Load: the manifest's files are split into one share per rank, balanced by bytes, each file in
exactly one share. A rank's share is not the files it loads: under resharding or data-parallel
replicas several ranks read the same file, and some files nobody reads (another layout's RNG
states); the even share reads every byte once, checks every file the manifest lists (as before),
and needs nothing from DCP's load planner.
"""

from __future__ import annotations

import json
import re
import time
import zlib
from pathlib import Path

from core.checkpoint.folder import INFO, MANIFEST, METADATA, CheckpointError, read_info
from core.fileio import atomic_write_json

ALGORITHM = "crc32"  # zlib.crc32: ~1.2 GB/s per core here, in the standard library, named in the manifest
CHUNK = 1 << 22
SHARD_RE = re.compile(r"^__(\d+)_\d+\.distcp$")  # DCP's per-rank shard files


def checksum(path: Path) -> int:
    """CRC32 of a file, read in chunks into one reused buffer (zlib releases the GIL on them)."""
    crc, buf = 0, bytearray(CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            crc = zlib.crc32(view[:n], crc)
    return crc


def written_by(folder: Path, rank: int) -> list[str]:
    """The files of `folder` that `rank` (its place in the save's group) wrote."""
    names = [p.name for p in folder.iterdir() if p.is_file() and _writer(p.name) == rank]
    return sorted(names)


def _writer(name: str) -> int | None:
    if name == METADATA:
        return 0  # DCP's coordinator
    m = SHARD_RE.match(name)
    return int(m.group(1)) if m else None


def checksum_files(folder: Path, names: list[str]) -> dict:
    """{"files": {name: {size, crc32}}, "bytes", "seconds"} of the named files of `folder`."""
    t0 = time.perf_counter()
    files = {n: {"size": (folder / n).stat().st_size, ALGORITHM: checksum(folder / n)} for n in names}
    return {"files": files, "bytes": sum(f["size"] for f in files.values()), "seconds": time.perf_counter() - t0}


def write_manifest(folder: Path, by_rank: list[dict]) -> int:
    """Rank 0, with every rank's `checksum_files` result: `MANIFEST`, written last (through a
    temporary name) so that its presence means the rest was complete. A file in `folder` that no
    rank claimed is checksummed here. Returns the folder's total bytes."""
    files: dict[str, dict] = {}
    for part in by_rank:
        files |= part["files"]
    unclaimed = sorted(
        p.name for p in folder.iterdir() if p.is_file() and p.name not in (MANIFEST, INFO) and p.name not in files
    )
    files |= checksum_files(folder, unclaimed)["files"]
    ranks = {
        str(r): {"files": sorted(part["files"]), "bytes": part["bytes"], "seconds": round(part["seconds"], 3)}
        for r, part in enumerate(by_rank)
    }
    manifest = {"algorithm": ALGORITHM, "files": dict(sorted(files.items())), "checksummed_by": ranks}
    atomic_write_json(folder / MANIFEST, manifest, indent=1)
    return sum(f["size"] for f in files.values()) + (folder / INFO).stat().st_size


def read_manifest(path: Path) -> dict | None:
    """The manifest's {name: {size, crc32}}; None for a checkpoint written before manifests
    existed; CheckpointError when it is missing though titan.json says there was one, or damaged."""
    f = path / MANIFEST
    if not f.is_file():
        if read_info(path).get("manifest"):
            raise CheckpointError(f"{f}: missing, though {INFO} says the checkpoint was saved with one")
        return None
    try:
        data = json.loads(f.read_text())
        files = data["files"]
        if data.get("algorithm", ALGORITHM) != ALGORITHM or not all(ALGORITHM in v for v in files.values()):
            raise KeyError(f"algorithm {data.get('algorithm')!r}, this reader checks {ALGORITHM}")
    except (OSError, json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, AttributeError) as e:
        raise CheckpointError(f"{f}: corrupted checkpoint manifest ({e})") from None
    return files


def shares(files: dict, world: int) -> list[list[str]]:
    """`world` lists of file names, each file in one, balanced by bytes (largest first onto the
    least loaded share); each list in the manifest's order."""
    load, out = [0] * world, [[] for _ in range(world)]
    for name in sorted(files, key=lambda n: -files[n]["size"]):
        r = load.index(min(load))
        out[r].append(name)
        load[r] += files[name]["size"]
    order = {n: i for i, n in enumerate(files)}
    return [sorted(s, key=order.__getitem__) for s in out]


def verify_files(path: Path, files: dict, names: list[str]) -> tuple[str, str] | None:
    """Check the named manifest entries against the files of `path`: (name, why) of the first that
    is missing, of another size, or of another CRC32; None when all match."""
    for name in names:
        try:
            why = _mismatch(path / name, files[name])
        except OSError as e:  # said like the others, so that every rank still joins the gather
            why = f"{path / name}: unreadable ({type(e).__name__}: {e})"
        if why:
            return name, why
    return None


def _mismatch(g: Path, want: dict) -> str | None:
    if not g.is_file():
        return f"{g}: missing (listed in {MANIFEST})"
    size = g.stat().st_size
    if size != want["size"]:
        return f"{g}: {size} bytes, the manifest says {want['size']} (truncated or grown)"
    if checksum(g) != want[ALGORITHM]:
        return (
            f"{g}: CRC32 mismatch at the same size ({size} bytes): the content changed "
            "after the save (disk or copy corruption)"
        )
    return None
