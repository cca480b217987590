"""The record `run-recipe run ID --mode dry-run` writes: does the layout compose at true scale
(the fake step), and the estimated peak memory per rank with each part shown (the accounting)."""

from __future__ import annotations

import copy
import time

from core.dryrun.fake_step import fake_step
from core.dryrun.gpuspec import DEFAULT_GPU, load_spec
from core.dryrun.memory import ALLOCATOR_GAP_GIB, estimate_memory
from core.dryrun.runtime import predict
from core.dryrun.software import PINNED
from core.dryrun.stack import THIS_TRAINER, Stack
from core.metrics import device_info
from core.parallel.mesh import ParallelDims
from core.validate import validate

METHOD = (
    "accounting: per-rank timeline of the step (core.dryrun.memory.estimate_memory) -> peak "
    f"allocated, + {ALLOCATOR_GAP_GIB} GiB caching-allocator gap -> peak reserved; fake step: "
    "the real layout on a fake process group of the row's world size, one training step "
    "under FakeTensorMode (core.dryrun.fake_step), torch's FSDPMemTracker/MemTracker "
    "measuring it where it applies"
)


def dry_run(cfg, fake: bool = True, track: bool | None = None, gpu: str = DEFAULT_GPU, software=None) -> dict:
    """The dry-run record of a validated paper config: does the layout compose at true scale,
    the estimated peak memory per rank with each part shown, and the predicted step time,
    tokens/s per GPU and MFU on the GPU system `gpu` (core/dryrun/hardware/<gpu>.toml).

    fake=False skips the fake step (accounting only, instant). track: see fake_step. When the
    tracker ran, the record also holds the accounting with the fake step's own semantics
    (eager, no allocator gap) and their difference, so the accounting is checked against
    torch's measurement of the real code on every tracked row.
    """
    t0 = time.perf_counter()
    cfg = validate(cfg, check_files=False)  # ConfigError naming the key for a bad layout
    dims = ParallelDims.from_config(cfg.parallelism)
    capacity = load_spec(gpu).hbm_capacity_gib  # an unknown name is refused here, listing the known ones
    sw = software or PINNED  # the software the prediction speaks for (core/dryrun/software.py)
    est = estimate_memory(cfg, gpu_gib=capacity, stack=sw.stack())
    record = {
        "recipe": cfg.job.recipe,
        "mode": "dry-run",
        "hardware": {"device": device_info()["device"]},  # where the fake step's seconds were measured
        "world_size": dims.world_size,
        "estimated_peak_gib": round(est["estimated_peak_gib"], 2),
        "estimated_peak_memory_gib": round(est["estimated_peak_gib"], 2),  # recipes/report/table_data.py's key
        "allocated_peak_gib": round(est["allocated_peak_gib"], 2),
        "breakdown": {k: round(v, 3) for k, v in est["breakdown"].items()},
        "peak_at": est["peak_at"],
        "worst_pp_rank": est["worst_pp_rank"],
        "per_pp_rank_allocated_gib": [round(x, 2) for x in est["per_pp_rank_allocated_gib"]],
        "layer_saved_gib_per_microbatch": round(est["layer_saved_gib"], 4),
        "microbatch_tokens_per_rank": est["microbatch_tokens_per_rank"],
        "fsdp_shard_degree": est["fsdp_shard_degree"],
        "gpu_capacity_gib": capacity,
        "fits_gpu": est["allocated_peak_gib"] <= capacity,
        "method": METHOD,
        "degrees": {
            "dp_replicate": dims.dp_replicate,
            "dp_shard": dims.dp_shard,
            "cp": dims.cp,
            "tp": dims.tp,
            "pp": dims.pp,
        },
        "composes": None,
        "predicted": predicted_record(cfg, gpu, sw.stack()),
        "software": {**sw.record(), "text": sw.text()},
    }
    if fake:
        try:
            fs = fake_step(cfg, track=track)
        except Exception as e:  # noqa: BLE001 - the record says what broke, the CLI reports it
            record.update(
                composes=False, error=f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
            )
        else:
            record["composes"] = True
            record["fake_step"] = fs
            if "tracker_peak_gib" in fs:
                eager = copy.deepcopy(cfg)
                eager.compile.enabled = False
                acc = estimate_memory(eager)
                # The tracker covers forward + backward; the accounting's peak is never the
                # optimizer step on these rows, and rank 0 is the rank the fake step ran.
                ours = acc["per_pp_rank_allocated_gib"][0]
                measured = fs["tracker_peak_gib"]["total"]
                record["tracker_check"] = {
                    "tracker_allocated_gib": round(measured, 3),
                    "accounting_eager_allocated_gib": round(ours, 3),
                    "difference_pct": round((ours - measured) / measured * 100, 2),
                    "note": (
                        "same semantics on both sides: eager, rank 0, no allocator gap"
                        + (
                            "; with loss parallel the tracker also counts DTensor's global-shape "
                            "propagation tensors (8 bytes per logit per TP rank)"
                            if dims.tp > 1 and cfg.parallelism.loss_parallel
                            else ""
                        )
                    ),
                }
    record["dry_run_s"] = round(time.perf_counter() - t0, 1)
    return record


def predicted_record(cfg, gpu: str = DEFAULT_GPU, stack: Stack = THIS_TRAINER) -> dict:
    """The performance model's prediction (core.dryrun.runtime.predict) for the software `stack`,
    rounded for the record."""
    pr = predict(cfg, gpu, stack=stack)
    b = pr["breakdown"]
    return {
        "gpu": pr["gpu"],
        "step_time_s": round(pr["step_time_s"], 4),
        "tokens_per_sec_per_gpu": round(pr["tokens_per_sec_per_gpu"], 1),
        "mfu": round(pr["mfu"], 4),
        "breakdown": {
            **{k: round(v, 4) for k, v in b.items() if k != "exposed_comm"},
            "exposed_comm": {k: round(v, 4) for k, v in b["exposed_comm"].items()},
        },
        "fits": pr["fits"],
        "capacity_gib": pr["capacity_gib"],
        "calibration": pr["calibration"],
        "error_band": pr["error_band"],
    }
