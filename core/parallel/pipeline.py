"""Pipeline parallelism with `torch.distributed.pipelining`: split, per-stage parallelize, schedule.

The whole model is cut into `pp x stages_per_rank` stages of consecutive blocks. Each stage is a
deep copy of the model with the other blocks deleted (and `tok_embeddings` / `norm` / `output`
set to None where they do not belong), so parameter names stay those of the whole model and
checkpoints line up across layouts. Each stage module then gets the same treatment as a whole
model (`parallelize`: TP -> float8 -> AC -> compile -> FSDP2) and becomes a `PipelineStage`.
Stages are placed on pp ranks round-robin ("loop": rank r holds r, r + pp, ...) or, for the
V-shaped schedules (ZBVZeroBubble, DualPipeV), as a V (rank r holds r and 2 pp - 1 - r), as
the library's own stage-to-rank mapping expects. That arithmetic (split, placement, microbatches)
lives in `core.parallel.stages`, without torch, where the config's checks and the dry-run read it.

Gradient scale: the loss function returns each microbatch's mean loss (divided by the gradient
accumulation steps) and the schedule divides the accumulated gradients by the microbatch count
(`scale_grads=True`), so the gradients equal those of one pass over the whole local batch.

`bubble_fraction` computes a schedule's ideal idle fraction from its own action table.
"""

from __future__ import annotations

import argparse
import copy
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
from tabulate import tabulate
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining import schedules as S
from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops
from torch.distributed.pipelining.schedules import PipelineScheduleSingle, _Action, get_schedule_class

from core.config import ConfigError, JobConfig
from core.parallel.stages import (
    PP_SCHEDULES,
    PP_SCHEDULES_SINGLE,
    default_stages_per_rank,
    plan_stages,
    pp_microbatches,
    stage_ids_for_rank,
)

# Costs of one microbatch on one stage, in units of a forward (stated, hardware independent):
# a full backward costs two forwards; zero-bubble schedules split it into an input-gradient
# part (I) and a weight-gradient part (W) of one forward each.
DEFAULT_COSTS = {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}


# ------------------------------------------------------------------------------------ schedules
def library_schedules() -> dict[str, type]:
    """Every schedule the installed torch exports, by the name `get_schedule_class` takes."""
    out = {}
    for attr in S.__all__:
        if attr.startswith("Schedule"):
            out[attr[len("Schedule") :]] = getattr(S, attr)
    return out


def schedule_class(name: str) -> type:
    """The schedule class for a config name; ConfigError listing the valid names otherwise."""
    if name not in PP_SCHEDULES:
        raise ConfigError(f"parallelism.pp_schedule: {name!r} is not one of: {', '.join(PP_SCHEDULES)}")
    try:
        return get_schedule_class(name)
    except ValueError:
        raise ConfigError(
            f"parallelism.pp_schedule: {name!r} is not offered by torch {torch.__version__} "
            f"(it offers: {', '.join(library_schedules())})"
        ) from None


# ------------------------------------------------------------------------------------ splitting
def stage_module(model: nn.Module, stage_id: int, layers: list[int], n_stages: int) -> nn.Module:
    """A deep copy of `model` holding only `layers` (FQNs unchanged)."""
    part = copy.deepcopy(model)
    keep = {str(i) for i in layers}
    for key in list(part.layers.keys()):
        if key not in keep:
            del part.layers[key]
    if stage_id != 0:
        part.tok_embeddings = None
    if stage_id != n_stages - 1:
        part.norm = None
        part.output = None
    return part


def _autocast_forward(module: nn.Module, device_type: str) -> None:
    """bf16 compute for a stage without FSDP (nothing else casts): autocast its forward only.

    The schedule computes the loss and runs backward outside the module, as the non-pipelined
    loop does outside its autocast region. An instance attribute keeps the FQNs unchanged.
    """
    forward = module.forward
    module.forward = torch.autocast(device_type, dtype=torch.bfloat16)(forward)


# ------------------------------------------------------------------------------------- building
class Pipeline(NamedTuple):
    """This rank's share of the pipeline, as build_pipeline made it (the schedule keeps its
    stages and microbatch count private: callers read them here)."""

    schedule: object
    parts: list[nn.Module]
    stages: list[PipelineStage]
    microbatches: int


def build_pipeline(
    model: nn.Module,
    mesh,
    dims,
    cfg: JobConfig,
    device: torch.device,
    loss_fn: Callable,
    toggles,
    parallelize: Callable,
) -> Pipeline:
    """Split `model` into this pp rank's stages, parallelize each, wrap them in the schedule.

    Returns the schedule, this rank's parts and stages (in stage order) and the microbatch count.
    """

    p = cfg.parallelism
    cls = schedule_class(p.pp_schedule)
    n_layers = len(model.layers)
    plan = plan_stages(cfg, n_layers)
    n_stages = len(plan)
    pp_mesh = mesh["pp"]
    pp_rank = pp_mesh.get_local_rank()
    ids = stage_ids_for_rank(pp_rank, dims.pp, n_stages, p.pp_schedule)
    bf16_autocast = cfg.training.mixed_precision_param == "bfloat16" and not dims.fsdp_enabled

    parts, stages = [], []
    for sid in ids:
        part = stage_module(model, sid, plan[sid], n_stages)
        part = parallelize(part, mesh, dims, cfg, toggles)
        if bf16_autocast:
            _autocast_forward(part, device.type)
        parts.append(part)
        stages.append(PipelineStage(part, sid, n_stages, device, group=pp_mesh.get_group()))

    micro = pp_microbatches(p, n_layers)
    if issubclass(cls, PipelineScheduleSingle):
        if len(stages) != 1:
            raise ConfigError(f"parallelism.pp_stages_per_rank: {p.pp_schedule} takes 1 stage per rank")
        schedule = cls(stages[0], n_microbatches=micro, loss_fn=loss_fn, scale_grads=True)
    else:
        schedule = cls(stages, n_microbatches=micro, loss_fn=loss_fn, scale_grads=True)
    toggles.apply(f"pp:{p.pp_schedule}")
    if bf16_autocast:
        toggles.apply("pp_autocast_bf16")
    return Pipeline(schedule, parts, stages, micro)


# -------------------------------------------------------------------------------- bubble fraction
def pipeline_order(schedule: str, pp: int, n_microbatches: int, stages_per_rank_: int) -> list[list]:
    """The schedule's own table of compute actions per rank (idle markers dropped), built from
    the library class without a process group (torch's `get_schedule_ops`)."""
    schedule_class(schedule)
    table = get_schedule_ops(schedule, pp, n_microbatches, stages_per_rank_)
    kinds = {"F", "B", "I", "W", "OVERLAP_F_B"}
    table = [[a for a in rank if a is not None and a.computation_type.value in kinds] for rank in table]
    return _renumber_if_needed(table, n_microbatches)


def _compute_parts(action):
    subs = action.sub_actions if action.computation_type.value == "OVERLAP_F_B" else None
    return list(subs) if subs else [action]


def _renumber_if_needed(table: list[list], m: int) -> list[list]:
    """torch 2.13's Schedule1F1B table numbers the last rank's forwards 1..m (its runtime loop,
    which the table only describes, runs 0..m-1). Where a stage's forwards, or its backwards
    (B and I together), do not list each microbatch exactly once, renumber that group in order
    of appearance."""

    def group(a):
        kind = a.computation_type.value
        return (a.stage_index, "BI" if kind in ("B", "I") else kind)

    seen: dict[tuple, list[int]] = {}
    for rank in table:
        for a in rank:
            for s in _compute_parts(a):
                seen.setdefault(group(s), []).append(s.microbatch_index)
    bad = {k for k, v in seen.items() if k[1] != "W" and sorted(v) != list(range(m))}
    if not bad:
        return table
    counters: dict[tuple, int] = {}

    def fix(a):
        key = group(a)
        if key not in bad:
            return a
        i = counters.get(key, 0)
        counters[key] = i + 1
        return _Action(a.stage_index, a.computation_type, i)

    out = []
    for rank in table:
        row = []
        for a in rank:
            if a.computation_type.value == "OVERLAP_F_B":
                row.append(
                    _Action(a.stage_index, a.computation_type, a.microbatch_index, tuple(fix(s) for s in a.sub_actions))
                )
            else:
                row.append(fix(a))
        out.append(row)
    return out


def simulate(table: list[list], n_stages: int, costs: dict[str, float] | None = None) -> dict:
    """Run each rank's actions in table order, each as early as its inputs allow.

    Dependencies: F(s, m) after F(s-1, m); the backward (B or I) of (s, m) after the backward
    of (s+1, m), or after F(s, m) on the last stage; W(s, m) after I(s, m). Communication is
    free. An OVERLAP_F_B runs its parts back to back. Returns makespan, per-rank busy time and
    the bubble fraction = idle / (ranks x makespan).
    """
    costs = {**DEFAULT_COSTS, **(costs or {})}
    done: dict[tuple, float] = {}
    pos = [0] * len(table)  # next action per rank
    free = [0.0] * len(table)
    busy = [0.0] * len(table)

    def deps(a):
        s, k, m = a.stage_index, a.computation_type.value, a.microbatch_index
        if k == "F":
            return [] if s == 0 else [[(s - 1, "F", m)]]
        if k in ("B", "I"):
            if s == n_stages - 1:
                return [[(s, "F", m)]]
            return [[(s + 1, "B", m), (s + 1, "I", m)], [(s, "F", m)]]  # any of each group
        return [[(s, "I", m), (s, "B", m)]]  # W

    def ready_at(a):
        t = 0.0
        for group in deps(a):
            times = [done[d] for d in group if d in done]
            if not times:
                return None
            t = max(t, min(times))
        return t

    remaining = sum(len(r) for r in table)
    while remaining:
        progressed = False
        for r, row in enumerate(table):
            while pos[r] < len(row):
                t = free[r]
                parts = _compute_parts(row[pos[r]])
                starts = []
                ok = True
                for s in parts:  # parts of an overlap depend only on other stages' work
                    at = ready_at(s)
                    if at is None:
                        ok = False
                        break
                    starts.append(at)
                if not ok:
                    break
                t = max([t, *starts])
                for s in parts:
                    c = costs[s.computation_type.value]
                    t += c
                    busy[r] += c
                    done[(s.stage_index, s.computation_type.value, s.microbatch_index)] = t
                free[r] = t
                pos[r] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            stuck = {r: str(row[pos[r]]) for r, row in enumerate(table) if pos[r] < len(row)}
            raise RuntimeError(f"pipeline table deadlocks at {stuck}")
    makespan = max(free)
    return {"makespan": makespan, "busy": busy, "bubble_fraction": 1.0 - sum(busy) / (len(table) * makespan)}


def bubble_fraction(
    schedule_name: str,
    pp: int,
    n_microbatches: int,
    stages_per_rank: int | None = None,
    costs: dict[str, float] | None = None,
) -> float:
    """Ideal idle fraction of `schedule_name` at pp ranks and n microbatches (hardware independent):
    simulate its own action table with stated costs (F 1, B 2 = I 1 + W 1, free communication).
    1F1B and GPipe give (pp - 1) / (m + pp - 1); interleaving v stages per rank divides the
    fill/drain by about v."""
    if stages_per_rank is None:
        stages_per_rank = default_stages_per_rank(schedule_name)
    table = pipeline_order(schedule_name, pp, n_microbatches, stages_per_rank)
    return simulate(table, pp * stages_per_rank, costs)["bubble_fraction"]


def bubble_rows(
    schedules: Sequence[str], pps: Sequence[int], microbatches: Sequence[int], looped_stages_per_rank: int = 2
) -> list[dict]:
    """Bubble fraction of each schedule x pp x microbatch count, and the ideal speed-up over 1F1B
    at the same pp and microbatches ((1 - bubble) / (1 - bubble_1F1B)). None where torch's
    schedule refuses the combination."""
    rows = []
    for pp in pps:
        for m in microbatches:
            try:
                base = bubble_fraction("1F1B", pp, m, 1)
            except (ValueError, AssertionError):
                base = None
            for name in schedules:
                spr = 1 if name in PP_SCHEDULES_SINGLE else looped_stages_per_rank
                try:
                    b = bubble_fraction(name, pp, m, spr)
                except (ValueError, AssertionError) as e:  # the library's own refusal
                    b, note = None, str(e).splitlines()[0]
                else:
                    note = ""
                rows.append(
                    {
                        "schedule": name,
                        "pp": pp,
                        "microbatches": m,
                        "stages_per_rank": spr,
                        "bubble_fraction": b,
                        "ideal_speedup_vs_1F1B": (1 - b) / (1 - base) if b is not None and base is not None else None,
                        "note": note,
                    }
                )
    return rows


def main(argv: list[str] | None = None) -> int:
    """`python -m core.parallel.pipeline --pp 8 --microbatches 8 32` prints bubble fractions."""

    ap = argparse.ArgumentParser(description="ideal pipeline bubble fraction per schedule")
    ap.add_argument("--pp", type=int, nargs="+", default=[2, 8])
    ap.add_argument("--microbatches", type=int, nargs="+", default=[8, 32])
    ap.add_argument("--stages-per-rank", type=int, default=2, help="for the looped schedules")
    ap.add_argument("--schedules", nargs="+", default=list(PP_SCHEDULES), choices=PP_SCHEDULES)
    a = ap.parse_args(argv)
    rows = bubble_rows(a.schedules, a.pp, a.microbatches, a.stages_per_rank)
    print(f"costs per microbatch and stage, in forwards: {DEFAULT_COSTS}; communication free")
    print(
        tabulate(
            [
                [
                    r["schedule"],
                    r["pp"],
                    r["microbatches"],
                    r["stages_per_rank"],
                    "" if r["bubble_fraction"] is None else f"{r['bubble_fraction']:.4f}",
                    "" if r["ideal_speedup_vs_1F1B"] is None else f"{r['ideal_speedup_vs_1F1B']:.3f}",
                    r["note"][:60],
                ]
                for r in rows
            ],
            headers=["schedule", "pp", "microbatches", "stages/rank", "bubble", "speed-up vs 1F1B", "note"],
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
