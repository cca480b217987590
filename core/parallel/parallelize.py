"""Apply every parallelism and toggle to one model (or one pipeline stage), in the order
PyTorch's composability needs: Float8 -> TP/SP (+ AsyncTP) -> activation checkpointing -> per-block
compile -> FSDP2. Each step is one small module; this file only decides which ones run.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.nn as nn

from core.config import JobConfig
from core.parallel.fsdp import apply_fsdp, fsdp_mesh
from core.parallel.mesh import ParallelDims, WorldMesh, group_roles
from core.parallel.tensor import apply_tp
from core.toggles.activation_checkpoint import apply_ac
from core.toggles.async_tp import apply_async_tp
from core.toggles.compile import apply_compile
from core.toggles.float8 import apply_float8, wants_precision_casts  # torchao itself is imported only when this runs


@dataclass
class Toggles:
    """What a run applied, and why anything asked for was not (copied into the result record)."""

    applied: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)

    def apply(self, name: str) -> None:
        if name not in self.applied:
            self.applied.append(name)

    def skip(self, name: str, reason: str) -> None:
        self.skipped[name] = reason


def parallelize(model: nn.Module, mesh: WorldMesh, dims: ParallelDims, cfg: JobConfig, toggles: Toggles) -> nn.Module:
    if cfg.float8.enabled:
        # Before TP: torchao's float8 TP styles (float8 all-gather) only accept Float8Linear.
        apply_float8(model, cfg, toggles)
    if dims.tp > 1:
        apply_tp(model, mesh["tp"], cfg, toggles)
        if cfg.parallelism.enable_async_tp:
            apply_async_tp(mesh["tp"], cfg, toggles)
    if cfg.activation_checkpoint.mode != "none":
        apply_ac(
            model, cfg.activation_checkpoint, toggles, save_every_other_mm=cfg.activation_checkpoint.save_every_other_mm
        )
    if cfg.compile.enabled:
        casts = wants_precision_casts(cfg)  # rowwise Float8 (pytorch#150859)
        apply_compile(
            model,
            cfg.compile,
            toggles,
            mesh.root.device_type,
            group_roles(mesh),
            precision_casts=casts,
            meshes=mesh.__getitem__,
        )
    if dims.fsdp_enabled:
        t, p = cfg.training, cfg.parallelism
        apply_fsdp(
            model,
            fsdp_mesh(mesh, dims.dp_replicate),
            t.mixed_precision_param,
            t.mixed_precision_reduce,
            p.fsdp_reshard_after_forward,
            pp_enabled=dims.pp > 1,
        )
        toggles.apply("hsdp" if dims.dp_replicate > 1 and dims.dp_shard * dims.cp > 1 else "fsdp")
    return model
