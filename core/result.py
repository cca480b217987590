"""The result record of a training run (`result.json`): what ran, on which versions and hardware,
and what it measured; built from the loop's TrainOutcome and written atomically by rank 0."""

from __future__ import annotations

import datetime
import platform
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

from core import cpu_gemm
from core.config import JobConfig, save_config
from core.fileio import atomic_write_json
from core.metrics import PeakFlops, device_info
from core.models.args import ModelArgs, shape_record
from core.parallel.schedule_sim import DEFAULT_COSTS, bubble_fraction
from core.provenance import git_state, provenance
from core.versions import installed_version


def versions() -> dict:
    out = {"torch": torch.__version__, "python": platform.python_version(), **git_state()}
    if (torchao := installed_version("torchao")) is not None:
        out["torchao"] = torchao
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


def pp_record(schedule: str, pp: int, microbatches: int, stages_per_rank: int) -> dict:
    """The schedule's ideal bubble (from its own action table; hardware independent)."""
    out = {
        "pp_schedule": schedule,
        "pp_microbatches": microbatches,
        "pp_stages_per_rank": stages_per_rank,
        "pp_bubble_costs": DEFAULT_COSTS,
    }
    try:
        out["pp_bubble_fraction"] = bubble_fraction(schedule, pp, microbatches, stages_per_rank)
    except (RuntimeError, ValueError, AssertionError) as e:  # never lose the run's record to it
        out["pp_bubble_fraction"], out["pp_bubble_error"] = None, str(e).splitlines()[0]
    return out


@dataclass
class TrainOutcome:
    """What a finished training loop hands to its record: plain values, the per-rank lists
    already gathered from every rank. `result_record` turns it into result.json."""

    cfg: JobConfig
    model_args: ModelArgs
    world_size: int
    device_type: str
    params: int | None  # the whole model's parameter count (None under PP: no rank holds it all)
    toggles_applied: list[str]
    toggles_skipped: dict[str, str]
    pipeline: dict  # pp_record(...) under PP, else {}
    start_step: int  # losses are those of steps start_step+1 ..
    losses: list[float]
    grad_norms: list[float]
    step_times_s: list[float]  # whole iterations: data + forward/backward + optimizer
    data_times_s: list[float]
    skipped_nonfinite_steps: list[int]
    history: dict  # {"from_step": S, "losses": [...], "grad_norms": [...]}: every step since S (1: the run's start)
    skipped_bad_documents: list
    wall_s: float
    tokens_per_step: int
    flops_per_token: float
    peak: PeakFlops  # flops None: a GPU without a known peak and no metrics.peak_flops (no MFU)
    peak_memory_gib_per_rank: list[float]  # steady state: the CUDA peak is reset after step 1
    first_step_peak_memory_gib_per_rank: list[float | None]
    param_bytes_per_rank: list[int]
    optimizer_bytes_per_rank: list[int]
    profile: dict | None = None  # the profiler window's summary (core.step_hooks), when one ran


def _throughput(o: TrainOutcome) -> dict:
    # Steady state: the first step pays for lazy init and compilation.
    steady = o.step_times_s[1:] or o.step_times_s
    mean_step = sum(steady) / len(steady) if steady else float("nan")
    tps = o.tokens_per_step / o.world_size / mean_step
    steady_data = o.data_times_s[1:] or o.data_times_s
    return {
        "data_time_s": sum(steady_data) / len(steady_data) if steady_data else None,
        "tokens_per_sec_per_device": tps,
        "flops_per_token": o.flops_per_token,
        "tflops_per_device": o.flops_per_token * tps / 1e12,
        "mfu": o.flops_per_token * tps / o.peak.flops if o.peak.flops else None,
        "mfu_formula": "(6*(N-N_emb) + 12*L*H*(D/H)*T) * tokens_per_sec_per_device / peak_flops",
    }


def _memory(o: TrainOutcome) -> dict:
    first = o.first_step_peak_memory_gib_per_rank
    return {
        "peak_memory_gib": max(o.peak_memory_gib_per_rank),
        "peak_memory_gib_per_rank": o.peak_memory_gib_per_rank,
        "first_step_peak_memory_gib": max((m for m in first if m is not None), default=None),
        "first_step_peak_memory_gib_per_rank": first,
        "memory_kind": "cuda max reserved, cache emptied and peak reset after step 1"
        if o.device_type == "cuda"
        else "cpu peak RSS (cannot be reset: includes step 1)",
        "param_bytes_per_rank": o.param_bytes_per_rank,
        "optimizer_bytes_per_rank": o.optimizer_bytes_per_rank,
    }


def result_record(o: TrainOutcome) -> dict:
    """result.json of a finished run."""
    info = device_info()
    record = {
        "recipe": o.cfg.job.recipe,
        "mode": o.cfg.job.mode,
        "config": o.cfg.to_dict(),
        "provenance": provenance(o.cfg),
        "versions": versions(),
        "hardware": {
            "device": info["device"],
            "world_size": o.world_size,
            "peak_flops": o.peak.flops,
            "peak_source": o.peak.source,
            "peak_gemm_route": o.peak.gemm_route,  # the route the peak was measured on ...
            "bf16_gemm": cpu_gemm.active(),  # ... and the one the steps ran (core.cpu_gemm)
            # core.cpu_gemm: CPU float8 matmuls in fp32 as torch emulates them (a GPU runs its own)
            "scaled_mm": "native" if torch.cuda.is_available() else cpu_gemm.scaled_mm_active(),
        },
        "world_size": o.world_size,
        # the resolved shape: flavor + model.* overrides
        "model": {"flavor": o.cfg.model.flavor, "params": o.params, **shape_record(o.model_args)},
        "toggles_applied": o.toggles_applied,
        "toggles_skipped": o.toggles_skipped,
        **o.pipeline,
        "steps": len(o.losses),
        "skipped_nonfinite_steps": o.skipped_nonfinite_steps,
        "skipped_bad_documents": o.skipped_bad_documents,
        "start_step": o.start_step,
        "losses": o.losses,
        "history": o.history,  # the steps before a resume too, from the checkpoint
        "grad_norms": o.grad_norms,
        "step_times_s": o.step_times_s,
        "data_times_s": o.data_times_s,
        **_throughput(o),
        **_memory(o),
        "wall_s": o.wall_s,
        "finished_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    if o.profile:
        record["profile"] = o.profile
    return record


def write_result(cfg: JobConfig, record: dict) -> None:
    """result.json and config.json in job.output_dir (rank 0 calls it)."""
    out = Path(cfg.job.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out / "result.json", record)  # a reader sees the old record or the new
    save_config(cfg, out / "config.json")


def summary(record: dict) -> str:
    """A finished run in one line, as `run-recipe run` ends each row: steps, final loss,
    throughput and peak memory per device (the full record is result.json)."""
    losses = record.get("losses") or []
    start = record.get("start_step", 0)
    if not losses and (record.get("config") or {}).get("checkpoint", {}).get("create_seed_checkpoint"):
        return "a seed checkpoint: the initial weights saved as step 0, nothing trained"
    steps = f"steps {start + 1}-{start + len(losses)}" if start else f"{len(losses)} steps"
    loss = f"final loss {losses[-1]:.4f}" if losses else "no step finished"
    mfu = f", MFU {record['mfu']:.1%}" if record.get("mfu") is not None else ""
    return (
        f"{steps}, {loss}, {record.get('tokens_per_sec_per_device', 0):,.0f} tokens/s/device{mfu}, "
        f"peak memory {record.get('peak_memory_gib', 0):.2f} GiB ({record.get('memory_kind', '?')})"
    )
