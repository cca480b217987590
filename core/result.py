"""The result record of a training run (`result.json`): what ran, on which versions and hardware,
and what it measured; built from a finished Trainer and written atomically by rank 0."""

from __future__ import annotations

import contextlib
import datetime
import importlib.metadata
import platform
import subprocess
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from core import cpu_gemm
from core.config import JobConfig, save_config
from core.fileio import atomic_write_json
from core.metrics import device_info, peak_memory_gib
from core.models.args import shape_record
from core.parallel.pipeline import DEFAULT_COSTS, bubble_fraction


def _git_commit(root: Path | None = None) -> str:
    """HEAD's short hash, "+modified" when the code (core/, recipes/) differs from it."""
    root = root or Path(__file__).resolve().parents[1]
    try:
        git = ["git", "-C", str(root)]
        head = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=5)
        changed = subprocess.run(
            [*git, "status", "--porcelain", "--", "core", "recipes"], capture_output=True, text=True, timeout=5
        )
    except (OSError, subprocess.TimeoutExpired):
        return ""
    commit = head.stdout.strip()
    return f"{commit}+modified" if commit and changed.stdout.strip() else commit


def versions() -> dict:
    out = {"torch": torch.__version__, "python": platform.python_version(), "git": _git_commit()}
    # the installed version, without importing torchao (only Float8 runs import it)
    with contextlib.suppress(importlib.metadata.PackageNotFoundError):
        out["torchao"] = importlib.metadata.version("torchao")
    return out


def _local_bytes(t: torch.Tensor) -> int:
    t = t.to_local() if isinstance(t, DTensor) else t
    return t.numel() * t.element_size()


def local_state_bytes(model_parts, optimizer) -> dict:
    """Bytes this rank holds of parameters and optimizer state (its shards only)."""
    params = sum(_local_bytes(p) for m in model_parts for p in m.parameters())
    optim = sum(
        _local_bytes(v)
        for state in optimizer.state.values()
        for v in state.values()
        if isinstance(v, torch.Tensor) and v.dim() > 0
    )
    return {"params": params, "optimizer": optim}


def pp_record(trainer) -> dict:
    """The schedule's ideal bubble (from its own action table; hardware independent)."""
    if trainer.pp_schedule is None:
        return {}
    p = trainer.cfg.parallelism
    spr, micro = len(trainer.step_fn.stages), trainer.pp_schedule._n_microbatches
    out = {
        "pp_schedule": p.pp_schedule,
        "pp_microbatches": micro,
        "pp_stages_per_rank": spr,
        "pp_bubble_costs": DEFAULT_COSTS,
    }
    try:
        out["pp_bubble_fraction"] = bubble_fraction(p.pp_schedule, trainer.dims.pp, micro, spr)
    except (RuntimeError, ValueError, AssertionError) as e:  # never lose the run's record to it
        out["pp_bubble_fraction"], out["pp_bubble_error"] = None, str(e).splitlines()[0]
    return out


def result_record(trainer, losses, grad_norms, step_times, wall, tokens_per_step, fpt, peak) -> dict:
    """The record of a finished `trainer.train()` (collective: every rank gathers the memory and
    state bytes of all ranks)."""
    # Steady state: the first step pays for lazy init and compilation.
    steady = step_times[1:] or step_times
    mean_step = sum(steady) / len(steady) if steady else float("nan")
    tps = tokens_per_step / trainer.world_size / mean_step
    mem = [None] * trainer.world_size
    dist.all_gather_object(mem, peak_memory_gib())
    first_mem = [None] * trainer.world_size
    memory = getattr(trainer, "memory", None)
    dist.all_gather_object(first_mem, memory.first_step if memory else None)
    data_times = getattr(trainer, "data_times", [])
    steady_data = data_times[1:] or data_times
    state_bytes = [None] * trainer.world_size
    dist.all_gather_object(state_bytes, local_state_bytes(trainer.model_parts, trainer.optimizer))
    info = device_info()
    return {
        "recipe": trainer.cfg.job.recipe,
        "mode": trainer.cfg.job.mode,
        "config": trainer.cfg.to_dict(),
        "versions": versions(),
        "hardware": {
            "device": info["device"],
            "world_size": trainer.world_size,
            "peak_flops": peak,
            "peak_source": info["peak_source"],
            "bf16_gemm": cpu_gemm.active(),  # core.cpu_gemm: fp32 where the CPU has no fast bf16 GEMM
        },
        "world_size": trainer.world_size,
        "model": {
            "flavor": trainer.cfg.model.flavor,
            "params": sum(p.numel() for m in trainer.model_parts for p in m.parameters())
            if trainer.dims.pp == 1
            else None,
            **shape_record(trainer.model_args),
        },  # the resolved shape: flavor + model.* overrides
        "toggles_applied": trainer.toggles.applied,
        "toggles_skipped": trainer.toggles.skipped,
        **pp_record(trainer),
        "steps": len(losses),
        "skipped_nonfinite_steps": list(trainer.skipped_steps),
        "skipped_bad_documents": getattr(trainer.dataloader, "bad_documents", []),
        "start_step": getattr(trainer, "start_step", 0),  # losses are of steps start_step+1..
        "losses": losses,
        "grad_norms": grad_norms,
        "step_times_s": step_times,  # whole iterations: data + forward/backward + optimizer
        "data_times_s": data_times,
        "data_time_s": sum(steady_data) / len(steady_data) if steady_data else None,
        "tokens_per_sec_per_device": tps,
        "flops_per_token": fpt,
        "tflops_per_device": fpt * tps / 1e12,
        "mfu": fpt * tps / peak,
        "mfu_formula": "(6*(N-N_emb) + 12*L*H*(D/H)*T) * tokens_per_sec_per_device / peak_flops",
        "peak_memory_gib": max(mem),  # steady state: the peak is reset after the first step
        "peak_memory_gib_per_rank": mem,
        "first_step_peak_memory_gib": max((m for m in first_mem if m is not None), default=None),
        "first_step_peak_memory_gib_per_rank": first_mem,
        "memory_kind": "cuda max reserved, reset after step 1"
        if trainer.device.type == "cuda"
        else "cpu peak RSS (cannot be reset: includes step 1)",
        "param_bytes_per_rank": [b["params"] for b in state_bytes],
        "optimizer_bytes_per_rank": [b["optimizer"] for b in state_bytes],
        "wall_s": wall,
        "finished_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def write_result(cfg: JobConfig, record: dict) -> None:
    """result.json and config.json in job.output_dir (rank 0 calls it)."""
    out = Path(cfg.job.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out / "result.json", record)  # a reader sees the old record or the new
    save_config(cfg, out / "config.json")
