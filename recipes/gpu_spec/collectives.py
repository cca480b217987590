"""All-gather, reduce-scatter and all-reduce across the local ranks: NCCL over the GPUs of this
node, or gloo between CPU processes (one thread each). Spawned with torch.multiprocessing; they
meet through a FileStore in a temporary folder (no port to pick).

Each collective is timed at a tiny and a large message; from these the link's figures the
model reads (core/dryrun/comms.py): the bus bandwidth of the ring collectives at the large size,
((n - 1) / n x S / t for all-gather and reduce-scatter of a gathered size S, 2 (n - 1) / n x S / t
for all-reduce), and the latencies, from the tiny messages: a ring all-gather costs
base + (n - 1) x step, a small all-reduce (a tree) base + 2 ceil(log2 n) x step.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from recipes.gpu_spec.benchmarks import typical

OPS = ("all_gather", "reduce_scatter", "all_reduce")
TINY_BYTES = 64


def _run(op: str, nbytes: int, rank: int, world: int, device: torch.device):
    n = max(world, nbytes // 4 // world * world)  # fp32 elements of the gathered / reduced tensor
    full = torch.ones(n, device=device)
    shard = torch.ones(n // world, device=device)
    if op == "all_gather":
        return lambda: dist.all_gather_single(full, shard)
    if op == "reduce_scatter":
        return lambda: dist.reduce_scatter_single(shard, full)
    return lambda: dist.all_reduce(full)


def _time(fn, device: torch.device, reps: int) -> float:
    """Typical seconds of one collective (benchmarks.typical), every rank starting together."""
    fn()
    samples = []
    for _ in range(reps):
        dist.barrier()
        t = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        samples.append(time.perf_counter() - t)
    return typical(samples)


def _worker(rank: int, world: int, backend: str, store_path: str, out: str, large_bytes: int, reps: int) -> None:
    if backend == "nccl":
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
    else:
        torch.set_num_threads(1)
        device = torch.device("cpu")
    store = dist.FileStore(store_path, world)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=300))
    try:
        result: dict = {}
        for op in OPS:
            tiny = _time(_run(op, TINY_BYTES, rank, world, device), device, reps)
            large = _time(_run(op, large_bytes, rank, world, device), device, reps)
            result[op] = {"tiny_s": tiny, "large_s": large}
        if rank == 0:
            Path(out).write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def measure(world: int, backend: str, large_bytes: int, reps: int) -> dict:
    """The collectives' times on `world` local ranks, and the link figures derived from them:
    {"world", "backend", "bytes", op: {tiny_s, large_s, busbw}, "busbw" (the ring collectives'
    mean), "peak_busbw" (the best of the three), "base_latency_s", "step_latency_s"}."""
    with tempfile.TemporaryDirectory(prefix="gpu_spec_collectives.") as tmp:
        out = os.path.join(tmp, "result.json")
        args = (world, backend, os.path.join(tmp, "store"), out, large_bytes, reps)
        mp.start_processes(_worker, args=args, nprocs=world, join=True, start_method="spawn")
        raw = json.loads(Path(out).read_text())
    n = world
    res: dict = {"world": n, "backend": backend, "bytes": large_bytes}
    for op in OPS:
        factor = (2 if op == "all_reduce" else 1) * (n - 1) / n
        res[op] = {**raw[op], "busbw": factor * large_bytes / raw[op]["large_s"]}
    res["busbw"] = (res["all_gather"]["busbw"] + res["reduce_scatter"]["busbw"]) / 2
    res["peak_busbw"] = max(res[op]["busbw"] for op in OPS)
    res["base_latency_s"], res["step_latency_s"] = latencies(
        n, raw["all_gather"]["tiny_s"], raw["all_reduce"]["tiny_s"]
    )
    return res


def latencies(n: int, ring_tiny_s: float, tree_tiny_s: float) -> tuple[float, float]:
    """(per-collective, per-step) latency from a tiny ring all-gather (base + (n - 1) step) and a
    tiny all-reduce (base + 2 ceil(log2 n) step). Where the two do not separate them (equal step
    counts, or a noisy pair giving a non-positive one), the ring's time is split evenly over its
    n - 1 steps and one base."""
    tree_steps = 2 * math.ceil(math.log2(n))
    if tree_steps != n - 1:
        step = (tree_tiny_s - ring_tiny_s) / (tree_steps - (n - 1))
        base = ring_tiny_s - (n - 1) * step
        if step > 0 and base > 0:
            return base, step
    return ring_tiny_s / n, ring_tiny_s / n
