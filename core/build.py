"""The one model builder: model args -> model (meta, or initialised on CPU) -> pipeline split or
parallelize -> materialise. The trainer, the dry-run's fake step and preflight call it; the
single-process reference starts from the same whole model (`create_model`), unparallelized.

Two ways to initialise (`model.init_device`):
- whole ("auto" on CPU): the whole model is initialised on every rank from the same seed (the
  caller seeds) and then sharded, so every layout starts from identical weights (loss parity).
- meta ("auto" on CUDA; "meta" runs it on CPU): built on the meta device, sharded, and each rank
  initialises only its own shards. The DTensor RNG tracker is created here, without state sync,
  over the non-PP sub-mesh, with the seed `job.seed + pp rank` (`seed_init_rng`): otherwise torch
  creates it lazily and broadcasts rank 0's state to the whole world, and pipeline stages, which
  draw the same sequence of shapes, start with identical blocks. Weights then differ from the
  whole-model init; runs whose loss must match another layout start from a seed checkpoint.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.distributed.tensor import _random as dtensor_random  # private: DTensor's RNG trackers, no public API

from core.config import JobConfig
from core.models.args import ModelArgs
from core.models.llama3 import create_model
from core.parallel.mesh import ParallelDims, WorldMesh, spmd_mesh
from core.parallel.parallelize import Toggles, parallelize
from core.parallel.pipeline import build_pipeline


@dataclass
class BuiltModel:
    """What build_model hands back for this rank: its model parts (one, or its pipeline stages
    in stage order) and, under PP, the schedule with the stages it runs here and its microbatch
    count (the schedule classes keep those private)."""

    parts: list[nn.Module]
    schedule: object | None = None
    stages: list = field(default_factory=list)
    microbatches: int = 1


def with_attention_dtype(args: ModelArgs, cfg: JobConfig, device: torch.device) -> ModelArgs:
    """The args with `model.attention_dtype` resolved for the device that trains (auto: float32 on
    CPU). Callers that train resolve it (trainer, reference loop); the dry-run's fake step, which
    stands for a GPU step, builds with the args as they are (the compute dtype)."""
    choice = cfg.model.attention_dtype
    fp32 = choice == "float32" or (choice == "auto" and device.type == "cpu")
    return dataclasses.replace(args, attention_fp32=fp32)


def meta_init(cfg: JobConfig, device: torch.device) -> bool:
    """Whether this run takes the meta-device path (always on CUDA; on CPU by config)."""
    return device.type != "cpu" or cfg.model.init_device == "meta"


class CPUOffsetRNGTracker(dtensor_random.OffsetBasedRNGTracker):
    """DTensor's offset-based RNG semantics on CPU, where torch has none (its tracker is
    CUDA-only and CPU's generator has no offset): each random op on a DTensor draws its local
    shard from a generator seeded by (seed, offset of that shard in the whole tensor), and every
    rank then advances the offset by the whole tensor's size, as the CUDA tracker does. So
    replicas draw the same values, shards of one tensor different ones, and the result does not
    depend on which rank runs it."""

    def __init__(self, seed: int):
        # private base class: its __init__ without OffsetBasedRNGTracker's CUDA-only checks
        dtensor_random._RNGStateTracker.__init__(self, torch.device("cpu"))
        self.seed, self.offset = seed, 0

    def _generator_seed(self, offset: int) -> int:
        digest = hashlib.sha256(f"{self.seed}:{offset}".encode()).digest()
        return int.from_bytes(digest[:8], "little") >> 1

    @contextlib.contextmanager  # overrides torch's private hook: a random op on a DTensor runs inside it
    def _distribute_region(self, spec, generator: torch.Generator | None = None):
        start, end = self._compute_rng_offsets(spec)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self._generator_seed(self.offset + start))
            yield
        self.offset += end


def seed_init_rng(mesh: WorldMesh, dims: ParallelDims, seed: int, device: torch.device, per_stage: bool = True) -> int:
    """Seed this rank for the meta path's init: `seed + pp rank` for torch's generator and a
    DTensor RNG tracker over the non-PP sub-mesh, created without state sync. Returns the seed.
    `per_stage=False` gives every stage the same seed (torch's lazy default; tests show the defect)."""
    stage_seed = seed + (mesh["pp"].get_local_rank() if per_stage and dims.pp > 1 else 0)
    torch.manual_seed(stage_seed)
    if device.type == "cpu":
        dtensor_random._rng_tracker = CPUOffsetRNGTracker(stage_seed)
    else:
        dtensor_random._rng_tracker = dtensor_random.OffsetBasedRNGTracker(spmd_mesh(mesh), run_state_sync=False)
    return stage_seed


def build_model(
    args: ModelArgs,
    cfg: JobConfig,
    mesh: WorldMesh,
    dims: ParallelDims,
    device: torch.device,
    toggles: Toggles,
    loss_fn: Callable | None = None,
    materialize: bool = True,
    per_stage_seed: bool = True,
) -> BuiltModel:
    """This rank's share of the model, parallelized (`loss_fn(logits, labels)` is the pipeline
    schedule's loss under PP).

    materialize False: the parts stay on the meta device, sharded (the fake step gives them
    fake storage itself). What was applied or skipped is recorded in `toggles`.
    """
    meta = meta_init(cfg, device) or not materialize
    # the whole model: on the meta device, or on CPU from the caller's seed (identical on every rank)
    model = create_model(args, device="meta" if meta else "cpu")
    if dims.pp > 1:
        pipe = build_pipeline(model, mesh, dims, cfg, device, loss_fn, toggles, parallelize)
        built = BuiltModel(pipe.parts, pipe.schedule, pipe.stages, pipe.microbatches)
    else:
        built = BuiltModel([parallelize(model, mesh, dims, cfg, toggles)])
    parts = built.parts
    if not materialize:
        return built
    if meta:
        # the trainer's generators stay as the caller seeded them; only the init draws per stage
        devices = [device] if device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices, device_type=device.type):
            seed_init_rng(mesh, dims, cfg.job.seed, device, per_stage=per_stage_seed)
            for part in parts:
                part.to_empty(device=device)
                with torch.no_grad():
                    part.init_weights(buffer_device=device)
        if device.type == "cpu":  # our CPU tracker served the init only
            dtensor_random._rng_tracker = None
        toggles.apply("meta_init")
    for part in parts:
        if not meta:
            part.to(device)
        part.train()
    return built
