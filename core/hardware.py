"""The hardware check of the efficiency toggles, made before anything is built.

`core.validate.validate` cannot see the GPUs; this can. The trainer's entry point calls it after
validate (and a launcher may call it before spawning ranks).
"""

from __future__ import annotations

from core.config import ConfigError, JobConfig
from core.toggles import async_tp, float8


def check_toggle_hardware(cfg: JobConfig) -> dict[str, str]:
    """Raise ConfigError (one line, naming the key) for a toggle this machine cannot run:
    Float8 on a CUDA GPU older than sm89 (any mode), AsyncTP without CUDA + NVLink/NVSwitch in
    real mode. Returns {toggle: reason} for what a proxy run will skip and record instead."""
    problem = float8.hardware_problem(cfg)
    if problem:
        raise ConfigError(problem)
    skipped = {}
    problem = async_tp.hardware_problem(cfg)
    if problem:
        if cfg.job.mode == "real":
            raise ConfigError(f"parallelism.enable_async_tp: {problem}")
        skipped["async_tp"] = problem
    return skipped
