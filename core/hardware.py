"""The hardware check of the efficiency toggles, made before anything is built.

`core.validate.validate` cannot see the GPUs; this can. The trainer's entry point calls it after
validate (and a launcher may call it before spawning ranks).
"""

from __future__ import annotations

import os

from core.config import ConfigError, JobConfig


def check_real_devices(cfg: JobConfig) -> None:
    """Real mode runs on CUDA GPUs, one per rank of this node (LOCAL_WORLD_SIZE, torchrun's): without
    them it would train the paper's model on CPUs and file the record as real. ConfigError says
    what is missing; called on every node before the process group."""
    if cfg.job.mode != "real":
        return
    import torch  # here: validate-only callers stay torch-free

    need = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if not torch.cuda.is_available():
        build = "a CPU-only build" if torch.version.cuda is None else f"CUDA {torch.version.cuda}, no GPU visible"
        raise ConfigError(
            f"job.mode: real mode needs CUDA GPUs: torch {torch.__version__} here is {build} "
            f"(host {os.uname().nodename}); use --mode proxy or --mode dry-run"
        )
    have = torch.cuda.device_count()
    if have < need:
        raise ConfigError(
            f"job.mode: real mode needs {need} GPUs on host {os.uname().nodename} (one per local rank), "
            f"{have} visible (CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')})"
        )


def check_toggle_hardware(cfg: JobConfig) -> dict[str, str]:
    """Raise ConfigError (one line, naming the key) for a toggle this machine cannot run:
    Float8 on a CUDA GPU older than sm89 (any mode), AsyncTP without CUDA + NVLink/NVSwitch in
    real mode. Returns {toggle: reason} for what a proxy run will skip and record instead."""
    from core.toggles import async_tp, float8  # here: they import torch, which `list` and `keys` never need

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
