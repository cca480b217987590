"""A recipe row: one line of a paper table, as data.

A row file (`<package>/<table>/<name>.toml`) holds:

    id = "llama3_8b/table1/8gpu_fsdp"     # = <package>/<table>/<name>, the file's own path
    title = "..."                          # human title
    table = "table1"                       # table1..table5 | loss_convergence
    row = "8 GPUs, FSDP"                   # the row label as the paper prints it
    order = 1                              # the row's position in the paper table
    techniques = ["fsdp", "compile"]       # fsdp, tp, async_tp, pp:<schedule>, cp, compile, float8
    baseline = "<id>"                      # optional: the row gains / loss deltas are measured against
    effect = "..."                         # optional: the published effect the row shows (results/dry_run.md)
                                           #   against its baseline, or in a table without baselines
                                           #   against the previous row (a throughput ratio)
    notes = "..."                          # optional
    [paper]            gpus, gpus_per_node
    [paper.config.*]   a JobConfig overlay (sections/keys of core/config.py): the paper's exact run
    [reference]        paper_tps_per_gpu, paper_mem_gib, paper_mem_approx, bench_tps_per_gpu, bench_mem_gib
    [proxy.config.*]   an overlay applied on top of the paper config for the proxy mode
    [requires]         real = [...], advisory = [...], proxy = [...]

Any of these may instead come from a `defaults.toml` (suite, package, table): see registry.py.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from typing import Any

from core.config import JobConfig, Mode, Parallelism, apply_dict

MODES = ("real", "proxy", "dry-run")
TABLES = ("table1", "table2", "table3", "table4", "table5", "loss_convergence")
REFERENCE_KEYS = ("paper_tps_per_gpu", "paper_mem_gib", "paper_mem_approx", "bench_tps_per_gpu", "bench_mem_gib")
TOP_KEYS = {
    "id",
    "title",
    "table",
    "row",
    "order",
    "techniques",
    "baseline",
    "effect",
    "notes",
    "paper",
    "reference",
    "proxy",
    "requires",
}
PARALLEL_DIMS = ("dp_replicate", "dp_shard", "cp", "tp", "pp")


class RecipeError(ValueError):
    """A malformed recipe file or an unknown recipe id."""


def deep_merge(base: dict, over: dict) -> dict:
    """A new dict: `over` merged into `base`; tables merge key by key, anything else replaces."""
    out = copy.deepcopy(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def slug(recipe_id: str) -> str:
    """The id as one path component: `llama3_8b/table1/8gpu_fsdp` -> `llama3_8b__table1__8gpu_fsdp`."""
    return recipe_id.replace("/", "__")


@dataclass(frozen=True)
class Recipe:
    id: str
    title: str
    table: str
    row: str
    techniques: tuple[str, ...]
    gpus: int
    gpus_per_node: int
    paper_config: dict[str, Any]  # merged JobConfig overlay of the paper run
    proxy_config: dict[str, Any]  # merged overlay applied on top of paper_config for proxy runs
    reference: dict[str, Any] = field(default_factory=dict)
    requires: dict[str, tuple[str, ...]] = field(default_factory=dict)
    baseline: str | None = None
    effect: str = ""
    notes: str = ""
    order: int = 0
    source: str = ""  # the row file, for messages

    # ------------------------------------------------------------------------------ configs
    def overlay(self, mode: str) -> dict[str, Any]:
        """The JobConfig overlay of a mode (real and dry-run: the paper config)."""
        if mode not in MODES:
            raise RecipeError(f"mode {mode!r} is not one of: {', '.join(MODES)}")
        if mode == "proxy":
            return deep_merge(self.paper_config, self.proxy_config)
        return copy.deepcopy(self.paper_config)

    def job_config(self, mode: Mode) -> JobConfig:
        """JobConfig defaults <- the mode's overlay, with job.recipe/mode/name set. Not validated."""
        cfg = apply_dict(JobConfig(), self.overlay(mode), self.source or self.id)
        cfg.job.recipe = self.id
        cfg.job.mode = mode
        cfg.job.name = slug(self.id)
        return cfg

    def degrees(self, mode: str) -> dict[str, int]:
        """Parallel degrees as written (dp_shard must be explicit in recipes: no -1 fill)."""
        p = self.overlay(mode).get("parallelism", {})
        return {d: p.get(d, getattr(Parallelism(), d)) for d in PARALLEL_DIMS}

    def world(self, mode: str) -> int:
        return math.prod(self.degrees(mode).values())

    def nnodes(self, world: int | None = None) -> int:
        world = self.gpus if world is None else world
        return max(1, -(-world // self.gpus_per_node))

    @property
    def fname(self) -> str:
        return slug(self.id)
