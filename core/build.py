"""The one model builder: model args -> model (meta, or initialised on CPU) -> pipeline split or
parallelize -> materialise. The trainer, the dry-run's fake step and the reference all call it.

On CPU the whole model is initialised on every rank from the same seed (the caller seeds) and
then sharded: DTensor's RNG is CUDA-only, and loss parity needs every layout to start from
identical weights. Elsewhere it is built on the meta device and each rank initialises its own
shards after parallelize.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn

from core.config import JobConfig
from core.models.args import ModelArgs
from core.models.llama3 import Transformer
from core.parallel.mesh import ParallelDims, WorldMesh
from core.parallel.parallelize import Toggles, parallelize
from core.parallel.pipeline import build_pipeline


def init_model(args: ModelArgs, meta: bool = False) -> Transformer:
    """The whole model: on the meta device (no storage), or on CPU initialised from torch's
    current RNG state."""
    if meta:
        with torch.device("meta"):
            return Transformer(args)
    model = Transformer(args)
    model.init_weights()
    return model


def build_model(args: ModelArgs, cfg: JobConfig, mesh: WorldMesh, dims: ParallelDims,
                device: torch.device, toggles: Toggles, loss_fn: Callable | None = None,
                materialize: bool = True) -> tuple[list[nn.Module], object | None]:
    """This rank's model parts (one, or its pipeline stages in stage order) and the pipeline
    schedule (None without PP; `loss_fn(logits, labels)` is the schedule's loss).

    materialize False: the parts stay on the meta device, sharded (the fake step gives them
    fake storage itself). What was applied or skipped is recorded in `toggles`.
    """
    on_cpu = device.type == "cpu" and materialize
    model = init_model(args, meta=not on_cpu)
    schedule = None
    if dims.pp > 1:
        schedule, parts = build_pipeline(model, mesh, dims, cfg, device, loss_fn, toggles, parallelize)
    else:
        parts = [parallelize(model, mesh, dims, cfg, toggles)]
    if not materialize:
        return parts, schedule
    for part in parts:
        if on_cpu:
            part.to(device)
        else:
            part.to_empty(device=device)
            with torch.no_grad():
                part.init_weights(buffer_device=device)
        part.train()
    return parts, schedule


def schedule_stages(schedule) -> list:
    """The pipeline stages a schedule runs on this rank (multi-stage and single-stage classes)."""
    return schedule._stages if hasattr(schedule, "_stages") else [schedule._stage]
