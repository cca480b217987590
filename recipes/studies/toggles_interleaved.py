"""Trainers side by side for the toggle benchmarks: the shared job overrides and `interleaved`, which
steps one world-1 trainer per variant round-robin so every ratio sees the same machine load."""

from __future__ import annotations

import statistics
import time

from core.config import load_config
from core.train import Trainer
from core.validate import validate
from recipes.studies.common import synthetic_job


def bench_overrides(flavor: str, seq_len: int, batch: int, steps: int, dtype: str) -> list[str]:
    return synthetic_job(
        flavor,
        seq_len,
        batch,
        steps,
        f"--training.mixed_precision_param={dtype}",
        "--lr_scheduler.warmup_steps=2",
        "--optimizer.lr=1e-3",
    )


def _trainer(base: list[str], extra: list[str], out: str):
    cfg = validate(load_config(None, base + extra + [f"job.output_dir={out}"]), 1, check_files=False)
    return Trainer(cfg)


def median(times: list[float]) -> float:
    return statistics.median(times)


def interleaved(
    base: list[str], variants: dict[str, list[str]], steps: int, warmup: int = 2, out: str = ""
) -> dict[str, dict]:
    """Build one trainer per variant (same seed, same token stream) and run their training steps
    round-robin, the order rotating each round: every variant sees the same machine load, so the
    ratios of their step times survive a busy shared CPU. The first `warmup` steps (lazy init,
    compilation) are not timed. Returns {name: {"times", "losses", "trainer"}}."""
    trainers = {name: _trainer(base, extra, f"{out}/{name.replace(':', '_')}") for name, extra in variants.items()}
    iters = {name: iter(t.dataloader) for name, t in trainers.items()}
    res = {name: {"times": [], "losses": [], "trainer": t} for name, t in trainers.items()}
    names = list(trainers)
    for step in range(warmup + steps):
        k = step % len(names)
        for name in names[k:] + names[:k]:
            t0 = time.perf_counter()
            loss, _ = trainers[name].train_step([next(iters[name])])
            dt = time.perf_counter() - t0
            res[name]["losses"].append(loss)
            if step >= warmup:
                res[name]["times"].append(dt)
    return res


def max_diff(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b, strict=True))
