"""What the studies share: the small synthetic job they measure, and a one-rank process group
for the studies that build trainers in their own process (bench, toggles_bench,
checkpoint_bench)."""

from __future__ import annotations

import contextlib

import torch.distributed as dist

from core.config import JobConfig, load_config
from core.train import init_distributed


def synthetic_job(flavor: str, seq_len: int, batch: int, steps: int, *extra: str) -> list[str]:
    """Overrides of a short job on the deterministic synthetic token stream (no assets, no
    progress bar), then `extra` (`--section.key=value`, later wins)."""
    return [
        f"--model.flavor={flavor}",
        "--data.dataset=synthetic",
        f"--training.seq_len={seq_len}",
        f"--training.local_batch_size={batch}",
        f"--training.steps={steps}",
        "--metrics.progress=false",
        *extra,
    ]


@contextlib.contextmanager
def one_rank_group(cfg: JobConfig | None = None):
    """The group found is left alone; one created here is destroyed on exit."""
    created = not dist.is_initialized()
    if created:
        init_distributed(cfg or load_config(None, []))
    try:
        if dist.get_world_size() != 1:
            raise RuntimeError("in-process studies run in one process (world 1)")
        yield
    finally:
        if created:
            dist.destroy_process_group()
