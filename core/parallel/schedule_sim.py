"""Pipeline schedules as action tables, and one list-scheduler that runs them.

`pipeline_order` takes a schedule's own table of compute actions per rank from torch (without a
process group). `run_schedule` runs such a table: each rank's actions in table order, each as
early as its inputs allow, with a cost per action and a cost per dependency on another stage.
Two callers: the bubble report here (`simulate`, `bubble_fraction`, `bubble_rows`, and
`python -m core.parallel.schedule_sim`: stated unit costs, free communication) and the dry-run
performance model (core/dryrun/runtime.py: seconds per action, PP send/recv per hop).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence

from tabulate import tabulate

# private: a schedule's action table without a process group, and its action type (no public API)
from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops
from torch.distributed.pipelining.schedules import _Action

from core.parallel.pipeline import schedule_class
from core.parallel.stages import PP_SCHEDULES, PP_SCHEDULES_SINGLE, default_stages_per_rank

# Costs of one microbatch on one stage, in units of a forward (stated, hardware independent):
# a full backward costs two forwards; zero-bubble schedules split it into an input-gradient
# part (I) and a weight-gradient part (W) of one forward each.
DEFAULT_COSTS = {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}


# ---------------------------------------------------------------------------------- the table
def pipeline_order(schedule: str, pp: int, n_microbatches: int, stages_per_rank_: int) -> list[list]:
    """The schedule's own table of compute actions per rank (idle markers dropped), built from
    the library class without a process group (torch's `get_schedule_ops`)."""
    schedule_class(schedule)
    table = get_schedule_ops(schedule, pp, n_microbatches, stages_per_rank_)
    kinds = {"F", "B", "I", "W", "OVERLAP_F_B"}
    table = [[a for a in rank if a is not None and a.computation_type.value in kinds] for rank in table]
    return _renumber_if_needed(table, n_microbatches)


def compute_parts(action) -> list:
    """The compute actions an entry of the table runs: its sub-actions for an OVERLAP_F_B."""
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
            for s in compute_parts(a):
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


# ------------------------------------------------------------------------------ the scheduler
def _dependencies(action, n_stages: int, hop: float) -> list[list[tuple[int, str, int, float]]]:
    """Groups of (stage, kind, microbatch, delay) the action waits for: all groups, any one
    action of each. F(s, m) after F(s-1, m); the backward (B or I) of (s, m) after F(s, m) and
    after the backward of (s+1, m); W(s, m) after I(s, m). A dependency on another stage waits
    `hop` longer (the send/recv)."""
    s, kind, m = action.stage_index, action.computation_type.value, action.microbatch_index
    if kind == "F":
        return [] if s == 0 else [[(s - 1, "F", m, hop)]]
    if kind in ("B", "I"):
        groups = [[(s, "F", m, 0.0)]]
        if s < n_stages - 1:
            groups.append([(s + 1, "B", m, hop), (s + 1, "I", m, hop)])
        return groups
    return [[(s, "I", m, 0.0), (s, "B", m, 0.0)]]  # W


def run_schedule(
    table: list[list], n_stages: int, cost: Callable[[int, str, int], float], hop: float = 0.0
) -> tuple[list[float], list[float]]:
    """Run each rank's actions in table order, each as early as its inputs allow (see
    `_dependencies`); `cost(stage, kind, microbatch)` is an action's duration, `hop` the delay of
    a dependency on another stage. An OVERLAP_F_B runs its parts back to back. Returns each
    rank's finish time and busy time; RuntimeError naming the stuck actions if the table
    deadlocks."""
    done: dict[tuple, float] = {}
    pos, free, busy = [0] * len(table), [0.0] * len(table), [0.0] * len(table)

    def ready(a):
        t = 0.0
        for group in _dependencies(a, n_stages, hop):
            times = [done[d[:3]] + d[3] for d in group if d[:3] in done]
            if not times:
                return None
            t = max(t, min(times))
        return t

    remaining = sum(len(r) for r in table)
    while remaining:
        progressed = False
        for r, row in enumerate(table):
            while pos[r] < len(row):
                parts = compute_parts(row[pos[r]])
                starts = [ready(x) for x in parts]  # parts of an overlap depend only on other stages' work
                if any(x is None for x in starts):
                    break
                t = max([free[r], *starts])
                for x in parts:
                    c = cost(x.stage_index, x.computation_type.value, x.microbatch_index)
                    t += c
                    busy[r] += c
                    done[(x.stage_index, x.computation_type.value, x.microbatch_index)] = t
                free[r], pos[r] = t, pos[r] + 1
                remaining -= 1
                progressed = True
        if not progressed:
            stuck = {r: str(row[pos[r]]) for r, row in enumerate(table) if pos[r] < len(row)}
            raise RuntimeError(f"pipeline table deadlocks at {stuck}")
    return free, busy


# --------------------------------------------------------------------------- bubble fraction
def simulate(table: list[list], n_stages: int, costs: dict[str, float] | None = None) -> dict:
    """`run_schedule` with a stated cost per action kind (DEFAULT_COSTS, overridable) and free
    communication. Returns makespan, per-rank busy time and the bubble fraction = idle /
    (ranks x makespan)."""
    costs = {**DEFAULT_COSTS, **(costs or {})}
    free, busy = run_schedule(table, n_stages, lambda stage, kind, micro: costs[kind])
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
    """`python -m core.parallel.schedule_sim --pp 8 --microbatches 8 32` prints bubble fractions."""

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
