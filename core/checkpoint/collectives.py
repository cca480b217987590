"""What the ranks of a checkpoint do together, on a process group of its own: the manifest
gathered from each rank's checksums of its own files, the verification before a load split across
ranks, the agreement that a background save finished everywhere, and rank 0's progress lines.

The checkpoint's group is gloo with `comm.checkpoint_timeout_seconds`: its collectives wait for
file-system I/O (a rank still writing, or still checksumming), which can take far longer than the
training timeout (`comm.train_timeout_seconds`, applied to every other group after the first
step; this one keeps its own: core/group_timeouts.py). Which files a rank checksums or verifies:
core/checkpoint/manifest.py.
"""

from __future__ import annotations

import contextlib
import datetime
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

from core.checkpoint.folder import CheckpointError, damaged_hint
from core.checkpoint.manifest import checksum_files, read_manifest, shares, verify_files, written_by
from core.group_timeouts import keep_own_timeout
from core.logs import get_logger

log = get_logger(__name__)

PROGRESS_EVERY_S = 60.0  # rank 0 reports a save (or a phase of one) that runs longer than this


def checkpoint_group(timeout_seconds: float) -> dist.ProcessGroup:
    """A gloo group of every rank for the checkpoint's collectives (a collective itself); it keeps
    its timeout after the first step (core/group_timeouts.py)."""
    return keep_own_timeout(dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_seconds)))


# ----------------------------------------------------------------------------------- save
def own_checksums(folder: Path, rank: int) -> dict:
    """This rank's part of the manifest: the checksums of the files it wrote (`checksum_files`),
    or {"error": the OSError} so that every rank still joins the gather and learns of it."""
    try:
        return checksum_files(folder, written_by(folder, rank))
    except OSError as e:
        return {"error": e}


def gather_checksums(part: dict, group) -> list[dict]:
    """Every rank's part, in rank order, on every rank (each waits only for the slowest rank's own
    files, never for a pass over the whole checkpoint)."""
    parts: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(parts, part, group=group)
    return parts


def all_done(done: bool, group) -> bool:
    """Whether `done` holds on every rank: the same answer everywhere, so that every rank starts
    the next checkpoint collective at the same step."""
    flag = torch.tensor([int(done)], dtype=torch.int32)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())


def slowest(parts: list[dict]) -> str:
    """The rank whose checksums took longest, for the progress line."""
    r = max(range(len(parts)), key=lambda i: parts[i].get("seconds", 0.0))
    return f"slowest rank {r}: {parts[r]['seconds']:.2f} s for {parts[r]['bytes'] / 2**30:.2f} GiB"


# ----------------------------------------------------------------------------------- load
def verification_plan(path: Path, world: int) -> dict | None:
    """Rank 0: the manifest's files and each rank's share of them; None for a checkpoint written
    before manifests existed. A missing or damaged manifest: CheckpointError with how to go on."""
    try:
        files = read_manifest(path)
    except CheckpointError as e:
        raise CheckpointError(f"{e}; {damaged_hint(path, path.parent)}") from None
    return None if files is None else {"files": files, "shares": shares(files, world)}


def verify_everywhere(path: Path, plan: dict, group) -> list[dict]:
    """Each rank checks its share of `plan`; every rank raises the same CheckpointError naming the
    first damaged file (in the manifest's order) with how to go on, before anything is loaded.
    Returns every rank's {"bytes", "seconds"}."""
    rank, files = dist.get_rank(group), plan["files"]
    mine = plan["shares"][rank]
    t0 = time.perf_counter()
    bad = verify_files(path, files, mine)
    part = {"bad": bad, "bytes": sum(files[n]["size"] for n in mine), "seconds": time.perf_counter() - t0}
    parts = gather_checksums(part, group)
    failures = [p["bad"] for p in parts if p["bad"]]
    if failures:
        order = {name: i for i, name in enumerate(files)}
        _, why = min(failures, key=lambda f: order[f[0]])
        raise CheckpointError(f"{why}; {damaged_hint(path, path.parent)}")
    return parts


# ------------------------------------------------------------------------------- progress
class SaveProgress:
    """Rank 0's lines for a long save. While a phase runs: one every PROGRESS_EVERY_S seconds
    ("saving step 10: DCP write, 120 s so far"); when a save that took longer is published: its
    phases ("saved step 10 in 185.2 s: DCP write 150.1 s, checksums 30.0 s (...), ...")."""

    def __init__(self, step: int, rank: int):
        self.step, self.report = step, rank == 0
        self.every = PROGRESS_EVERY_S
        self.t0 = time.perf_counter()
        self.phases: dict[str, float] = {}
        self.notes: dict[str, str] = {}

    @contextlib.contextmanager
    def phase(self, name: str):
        t, stop = time.perf_counter(), threading.Event()
        if self.report and self.every > 0:
            threading.Thread(target=self._tick, args=(name, t, stop), daemon=True).start()
        try:
            yield
        finally:
            stop.set()
            self.add(name, time.perf_counter() - t)

    def _tick(self, name: str, t: float, stop: threading.Event) -> None:
        while not stop.wait(self.every):
            log.info(f"[checkpoint] saving step {self.step}: {name}, {time.perf_counter() - t:.0f} s so far")

    def add(self, name: str, seconds: float, note: str = "") -> None:
        self.phases[name] = self.phases.get(name, 0.0) + seconds
        if note:
            self.notes[name] = note

    def done(self) -> None:
        total = time.perf_counter() - self.t0
        if not self.report or total < self.every:
            return
        phases = ", ".join(
            f"{k} {v:.2f} s" + (f" ({self.notes[k]})" if k in self.notes else "") for k, v in self.phases.items()
        )
        log.info(f"[checkpoint] saved step {self.step} in {total:.2f} s: {phases}")
