"""A trainer process's jobs: its command line (`python -m core.train --config JOB [--config JOB2 ...]
[--section.key=value ...]`), every job validated before any runs, and how its rank marks its
error lines."""

from __future__ import annotations

import argparse
import os

import torch.distributed as dist

from core.config import ConfigError, JobConfig, load_config
from core.hardware import check_real_devices, check_toggle_hardware
from core.validate import validate


def parse_jobs(argv: list[str] | None = None) -> list[JobConfig]:
    """One config per `--config` (the overrides apply to each); none given: the defaults."""
    parser = argparse.ArgumentParser(
        description="Train one or more jobs (torchrun launches it on every rank).", prog="python -m core.train"
    )
    parser.add_argument("--config", action="append", help="job config (.toml or .json); repeatable")
    known, overrides = parser.parse_known_args(argv)
    return [load_config(path, overrides) for path in (known.config or [None])]


def validated_jobs(argv: list[str] | None) -> list[JobConfig]:
    """Every job of the command line, validated before any runs (ConfigError names the key)."""
    world = int(os.environ.get("WORLD_SIZE", 0)) or None
    cfgs = [validate(cfg, world) for cfg in parse_jobs(argv)]
    for cfg in cfgs:
        check_toggle_hardware(cfg)  # GPUs validate() cannot see: Float8 sm89+, AsyncTP (real mode)
        check_real_devices(cfg)  # real mode: CUDA and a GPU per local rank, on every node
    if any(cfg.comm != cfgs[0].comm for cfg in cfgs):
        raise ConfigError("comm: jobs launched together share one process group: their [comm] must match")
    if "RANK" not in os.environ and cfgs[0].parallelism.world_size > 1:
        n = cfgs[0].parallelism.world_size
        raise ConfigError(
            f"parallelism: a world of {n} ranks needs torchrun (--nproc_per_node={n}) or `run-recipe run`"
        )
    return cfgs


def rank_prefix() -> str:
    """How a rank other than 0 marks its error lines (as torch marks its tracebacks): the launcher
    names the rank that failed first from them (recipes/output.py `failure_cause`)."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    return f"[rank{rank}]: " if rank else ""
