"""Scale simulation of the checkpoint checksums (issue 27). W ranks on gloo each own a large
shard file (sparse: os.truncate, so no disk space is used) in a checkpoint folder's layout, then
run what core/checkpoint/checkpointer.py runs after a save and before a load: each rank checksums the files it
wrote, every rank gets the parts and rank 0 writes the manifest; each rank verifies its share.
Prints each rank's checksum time (wall and this rank's CPU) and how long it then waited for the
others (and, with --baseline, the time rank 0 alone takes over every file, as before issue 27).

Reading a sparse file's holes needs no disk: the first read fills the page cache with zero
pages (timed apart, as `first_read_s`), after which CRC32 is CPU-bound. The timed passes run on
the cached files: checksum throughput on this CPU, not a file system's; W ranks on fewer cores
share them (the report gives the load average).

    python scripts/checkpoint_checksum_sim.py --world 4 --mib 2048 [--dir DIR] [--json OUT] [--baseline]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from any directory

from core.checkpoint.collectives import (
    checkpoint_group,
    gather_checksums,
    own_checksums,
    verification_plan,
    verify_everywhere,
)
from core.checkpoint.folder import INFO, METADATA, publish, step_dir, tmp_dir
from core.checkpoint.manifest import ALGORITHM, checksum_files, write_manifest
from core.fileio import atomic_write_json
from core.metrics import cpu_model
from core.result import versions

TIMEOUT_S = 1800.0


def make_shards(folder: Path, rank: int, size: int) -> None:
    """This rank's shard `__R_0.distcp` of `size` bytes (sparse); rank 0 also `.metadata` and titan.json."""
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / f"__{rank}_0.distcp", "wb") as f:
        os.truncate(f.fileno(), size)
    if rank == 0:
        (folder / METADATA).write_bytes(os.urandom(64 << 10))
        (folder / INFO).write_text(json.dumps({"step": 1, "kind": "full", "manifest": "manifest.json"}))


def first_read(path: Path) -> float:
    """Read a file once (the page cache takes its holes' zero pages); the seconds it took."""
    t0, buf = time.perf_counter(), bytearray(1 << 22)
    with open(path, "rb", buffering=0) as f:
        while f.readinto(buf):
            pass
    return time.perf_counter() - t0


def save_side(folder: Path, rank: int, group) -> dict:
    """After the shards exist: own checksums, the gather, rank 0's manifest and rename."""
    tmp = tmp_dir(folder, 1)
    dist.barrier(group=group)
    t0, cpu0 = time.perf_counter(), time.thread_time()
    mine = own_checksums(tmp, rank)
    t1, cpu = time.perf_counter(), time.thread_time() - cpu0
    parts = gather_checksums(mine, group)
    t2 = time.perf_counter()
    if rank == 0:
        write_manifest(tmp, parts)
        publish(tmp, folder, 1)
    return {
        "checksummed": sorted(mine["files"]),
        "checksum_gib": mine["bytes"] / 2**30,
        "checksum_s": t1 - t0,
        "checksum_cpu_s": cpu,  # this rank's own work, whatever else shares the cores
        "gather_wait_s": t2 - t1,
    }


def load_side(folder: Path, rank: int, world: int, group) -> dict:
    """Rank 0's verification plan, broadcast; each rank verifies its share."""
    path = step_dir(folder, 1)
    box = [verification_plan(path, world) if rank == 0 else None]
    dist.broadcast_object_list(box, src=0, group=group)
    t0 = time.perf_counter()
    parts = verify_everywhere(path, box[0], group)
    total = time.perf_counter() - t0
    return {"verify_s": parts[rank]["seconds"], "verify_wait_s": total - parts[rank]["seconds"]}


def rank_main(rank: int, world: int, args: argparse.Namespace, store: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    group = checkpoint_group(TIMEOUT_S)
    folder = Path(args.dir)
    make_shards(tmp_dir(folder, 1), rank, args.mib << 20)
    row = {"rank": rank, "first_read_s": first_read(tmp_dir(folder, 1) / f"__{rank}_0.distcp")}
    row |= save_side(folder, rank, group) | load_side(folder, rank, world, group)
    rows: list = [None] * world
    dist.all_gather_object(rows, row, group=group)
    baseline = None
    if args.baseline:  # before issue 27: rank 0 alone over every file while the others wait
        dist.barrier(group=group)
        if rank == 0:
            path, cpu0 = step_dir(folder, 1), time.thread_time()
            baseline = checksum_files(path, sorted(p.name for p in path.iterdir() if p.name.startswith("__")))
            baseline["cpu_seconds"] = time.thread_time() - cpu0
        dist.barrier(group=group)
    if rank == 0:
        report(rows, baseline, folder, args)
    dist.destroy_process_group()


def report(rows: list[dict], baseline: dict | None, folder: Path, args: argparse.Namespace) -> None:
    manifest = json.loads((step_dir(folder, 1) / "manifest.json").read_text())
    out = {
        "world": len(rows),
        "shard_mib": args.mib,
        "algorithm": ALGORITHM,
        "manifest_files": len(manifest["files"]),
        "ranks": rows,
        "baseline_rank0_alone_s": baseline["seconds"] if baseline else None,
        "baseline_rank0_alone_cpu_s": baseline["cpu_seconds"] if baseline else None,
        "machine": {"cpu": cpu_model(), "cores": os.cpu_count()},
        "load_average_1m_at_end": os.getloadavg()[0],
        "versions": {"python": platform.python_version(), **versions()},  # torch, torchao, git commit
        "finished_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    print(
        f"{len(rows)} ranks, {args.mib} MiB sparse shard each, {ALGORITHM}, {os.cpu_count()} cores, "
        f"load average {os.getloadavg()[0]:.1f}"
    )
    print("rank  first_read_s  checksum_s  cpu_s  GiB/s  gather_wait_s  verify_s  verify_wait_s")
    for r in rows:
        rate = r["checksum_gib"] / r["checksum_s"] if r["checksum_s"] else float("nan")
        print(
            f"{r['rank']:>4}  {r['first_read_s']:>12.2f}  {r['checksum_s']:>10.2f}  {r['checksum_cpu_s']:>5.2f}  "
            f"{rate:>5.2f}  "
            f"{r['gather_wait_s']:>13.2f}  {r['verify_s']:>8.2f}  {r['verify_wait_s']:>13.2f}"
        )
    if baseline:
        print(
            f"rank 0 alone over all {len(rows)} shards (before issue 27): {baseline['seconds']:.2f} s "
            f"({baseline['cpu_seconds']:.2f} s CPU)"
        )
    if args.json:
        atomic_write_json(Path(args.json), out, indent=1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--mib", type=int, default=2048, help="each rank's shard size (MiB)")
    parser.add_argument("--dir", default="", help="the checkpoint folder (default: a temporary one)")
    parser.add_argument("--json", default="", help="also write the report here")
    parser.add_argument("--baseline", action="store_true", help="also time rank 0 alone over every shard")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as scratch:
        args.dir = args.dir or str(Path(scratch) / "checkpoint")
        mp.spawn(rank_main, args=(args.world, args, str(Path(scratch) / "store")), nprocs=args.world)
    return 0


if __name__ == "__main__":
    sys.exit(main())
