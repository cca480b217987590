"""Measure the efficiency toggles on the CPU proxy; write results/toggles.{md,csv}.

Called by `run-recipe bench` (`benchmark_rows(quick)` -> rows of results/benchmarks.csv) or
alone: `run-recipe toggles-bench [--quick]`. Every figure is measured afresh; each ratio
compares runs made one right after the other in this invocation (the machine is shared, so
absolute times drift; ratios of interleaved runs much less). Sections:

- activation checkpointing: per mode, peak activation and total memory of one training step
  (torch's MemTracker: every live tensor by role, so the ~400 MB process baseline that CPU RSS
  carries does not hide the difference) and the step time;
- regional compile: step time eager vs per-block compiled, and the cold compile time (wall and
  CPU) of per-block vs whole-model compile, each in a fresh process with an empty inductor
  cache, plus per-block again on the warm cache;
- Float8: per recipe, max |loss - bf16 loss| over the steps and the step-time ratio (world 1,
  bf16 autocast), and FSDP2 with float8 all-gather at world 2 against FSDP2 bf16.
Step times come from real Trainers (world 1) built side by side and stepped round-robin
(`interleaved`), so a burst of load from other jobs hits every variant alike.
This module holds the AC and compile-speedup measurements and the tables; the round-robin harness
is in toggles_interleaved, the cold-compile probe in toggles_probe, the Float8 section in toggles_float8.
"""

from __future__ import annotations

import tempfile
from importlib import resources
from pathlib import Path

import click
import tomllib
import torch
from tabulate import tabulate
from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType

from core.fileio import atomic_write, atomic_write_json
from recipes import paths
from recipes.report.results import write_csv
from recipes.studies.common import one_rank_group
from recipes.studies.toggles_float8 import float8_deviation, float8_fsdp
from recipes.studies.toggles_interleaved import bench_overrides, interleaved, max_diff, median
from recipes.studies.toggles_probe import cold_compile

CSV_COLUMNS = ["section", "name", "metric", "value", "unit", "ratio", "ratio_of", "notes"]
AC_MODES = {
    "none": [],
    "ac:full": ["activation_checkpoint.mode=full"],
    "ac:op": ["activation_checkpoint.mode=selective", "activation_checkpoint.selective_ac_option='op'"],
    "ac:layer2": ["activation_checkpoint.mode=selective", "activation_checkpoint.selective_ac_option='2'"],
}


# ---------------------------------------------------------------------------------------- AC
def ac_table(
    flavor: str = "debug", seq_len: int = 256, batch: int = 8, steps: int = 6, dtype: str = "float32"
) -> list[dict]:
    """Per AC mode: peak activation / total MiB of one train step (MemTracker), step time
    (interleaved trainers), max loss diff vs no AC."""
    base = bench_overrides(flavor, seq_len, batch, steps, dtype)
    rows = []
    with one_rank_group(), tempfile.TemporaryDirectory() as tmp:
        runs = interleaved(base, AC_MODES, steps, out=tmp)
        for name, run in runs.items():
            trainer = run["trainer"]
            tracker = MemTracker()
            tracker.track_external(*trainer.model_parts, trainer.optimizer)
            with tracker:
                trainer.train_step([next(iter(trainer.dataloader))])
            peak = tracker.get_tracker_snapshot("peak")
            rows.append(
                {
                    "mode": name,
                    "act_mib": sum(v.get(_MemRefType.ACT, 0) for v in peak.values()) / 2**20,
                    "total_mib": sum(v.get("Total", 0) for v in peak.values()) / 2**20,
                    "step_s": median(run["times"]),
                    "losses": run["losses"],
                    "applied": list(trainer.toggles.applied),
                }
            )
        del runs
    ref = rows[0]
    for r in rows:
        r["act_ratio"] = r["act_mib"] / ref["act_mib"]
        r["time_ratio"] = r["step_s"] / ref["step_s"]
        r["max_loss_diff"] = max_diff(r["losses"], ref["losses"])
    return rows


# ----------------------------------------------------------------------------------- compile
def compile_speedup(
    flavor: str = "debug", seq_len: int = 256, batch: int = 8, steps: int = 10, dtype: str = "bfloat16"
) -> dict:
    """Step time eager vs per-block compile (trainers interleaved step by step, world 1)."""
    base = bench_overrides(flavor, seq_len, batch, steps, dtype)
    with one_rank_group(), tempfile.TemporaryDirectory() as tmp:
        runs = interleaved(base, {"eager": [], "compile": ["compile.enabled=true"]}, steps, out=tmp)
    eager, compiled = median(runs["eager"]["times"]), median(runs["compile"]["times"])
    return {
        "eager_step_s": eager,
        "compile_step_s": compiled,
        "speedup": eager / compiled,
        "max_loss_diff": max_diff(runs["eager"]["losses"], runs["compile"]["losses"]),
        "applied": list(runs["compile"]["trainer"].toggles.applied),
        "shape": f"{flavor}, seq {seq_len}, batch {batch}, {dtype}",
    }


# ----------------------------------------------------------------------------------- writing
def measure(quick: bool = False) -> dict:
    if quick:
        shape = {"flavor": "tiny4", "seq_len": 64, "batch": 4}
        return {
            "ac": ac_table(steps=3, **shape),
            "compile": compile_speedup(steps=4, **shape),
            "cold": cold_compile(**shape),
            "float8": float8_deviation(steps=4, **shape),
            "float8_fsdp": float8_fsdp(steps=4),
            "quick": True,
        }
    return {
        "ac": ac_table(),
        "compile": compile_speedup(),
        "cold": cold_compile(),
        "float8": float8_deviation(),
        "float8_fsdp": float8_fsdp(),
        "quick": False,
    }


def csv_rows(m: dict) -> list[dict]:
    rows = []

    def add(section, name, metric, value, unit, ratio="", ratio_of="", notes=""):
        rows.append(
            {
                "section": section,
                "name": name,
                "metric": metric,
                "value": f"{value:.6g}",
                "unit": unit,
                "ratio": f"{ratio:.4g}" if ratio != "" else "",
                "ratio_of": ratio_of,
                "notes": notes,
            }
        )

    for r in m["ac"]:
        add(
            "ac",
            r["mode"],
            "peak_activation",
            r["act_mib"],
            "MiB",
            r["act_ratio"],
            "/ none",
            f"total peak {r['total_mib']:.1f} MiB; max loss diff vs none {r['max_loss_diff']:.1e}",
        )
        add("ac", r["mode"], "step_time", r["step_s"], "s", r["time_ratio"], "/ none")
    c = m["compile"]
    add(
        "compile",
        "per_block",
        "step_time",
        c["compile_step_s"],
        "s",
        c["speedup"],
        "eager / compiled",
        f"eager {c['eager_step_s']:.4f} s; {c['shape']}; max loss diff {c['max_loss_diff']:.1e}",
    )
    k = m["cold"]
    for key in ("block_cold", "whole_cold", "block_warm"):
        add(
            "compile",
            key,
            "first_step_compile",
            k[key]["compile_s"],
            "s",
            k[key]["compile_s"] / k["block_cold"]["compile_s"],
            "/ block_cold",
            f"CPU time {k[key]['compile_cpu_s']:.1f} s "
            f"(x{k[key]['compile_cpu_s'] / k['block_cold']['compile_cpu_s']:.2f}); "
            f"first step {k[key]['first_step_s']:.2f} s, steady {k[key]['steady_step_s']:.3f} s",
        )
    for r in m["float8"]:
        add(
            "float8",
            r["recipe"],
            "max_loss_diff_vs_bf16",
            r["max_loss_diff"],
            "loss",
            r["time_ratio"],
            "step time / bf16",
            f"final loss {r['final_loss']:.4f} vs bf16 {r['bf16_final_loss']:.4f}",
        )
    f = m["float8_fsdp"]
    add(
        "float8",
        "fsdp2_float8_all_gather",
        "max_loss_diff_vs_bf16_reference",
        f["float8"]["max_loss_diff"],
        "loss",
        f["float8"]["step_s"] / f["bf16"]["step_s"],
        "step time / fsdp2 bf16",
        f"{f['shape']}; vs FSDP2 bf16 (float8 alone): {f['float8_vs_fsdp_bf16']:.1e}; "
        f"FSDP2 bf16 vs reference: {f['bf16']['max_loss_diff']:.1e}",
    )
    return rows


def markdown(m: dict) -> str:
    """results/toggles.md: the page of recipes/studies/toggles_bench.toml with m's figures and tables."""
    text = tomllib.loads((resources.files("recipes.studies") / "toggles_bench.toml").read_text(encoding="utf-8"))
    f = m["float8_fsdp"]
    return text["page"].format(
        torch=torch.__version__,
        quick=text["quick"] if m["quick"] else "",
        c=m["compile"],
        k=m["cold"],
        f=f,
        float8_step_ratio=f["float8"]["step_s"] / f["bf16"]["step_s"],
        ac_table=_ac_table(m["ac"]),
        cold_table=_cold_table(m["cold"]),
        float8_table=_float8_table(m["float8"]),
    )


def _github_table(rows: list[dict], columns: list[tuple[str, str, str]]) -> str:
    """A Markdown table of `rows`: one column per (header, key, format spec)."""
    return tabulate(
        [[format(r[key], spec) for _, key, spec in columns] for r in rows],
        headers=[header for header, _, _ in columns],
        tablefmt="github",
    )


def _ac_table(rows: list[dict]) -> str:
    columns = [("mode", "mode", ""), ("peak activations MiB", "act_mib", ".1f"), ("x none", "act_ratio", ".2f")]
    columns += [("peak total MiB", "total_mib", ".1f"), ("step s", "step_s", ".3f"), ("x none", "time_ratio", ".2f")]
    return _github_table(rows, [*columns, ("max loss diff", "max_loss_diff", ".1e")])


def _cold_table(k: dict) -> str:
    base = k["block_cold"]
    rows = [
        {
            "key": key,
            **k[key],
            "wall_ratio": k[key]["compile_s"] / base["compile_s"],
            "cpu_ratio": k[key]["compile_cpu_s"] / base["compile_cpu_s"],
        }
        for key in ("block_cold", "whole_cold", "block_warm")
    ]
    columns = [("compile", "key", ""), ("wall s", "compile_s", ".1f"), ("x block cold", "wall_ratio", ".2f")]
    columns += [("CPU s", "compile_cpu_s", ".1f"), ("x block cold", "cpu_ratio", ".2f")]
    return _github_table(rows, [*columns, ("steady step s", "steady_step_s", ".3f")])


def _float8_table(rows: list[dict]) -> str:
    columns = [("recipe", "recipe", ""), ("max abs loss diff", "max_loss_diff", ".2e")]
    columns += [("final loss", "final_loss", ".4f"), ("bf16 final loss", "bf16_final_loss", ".4f")]
    return _github_table(rows, [*columns, ("step time x bf16", "time_ratio", ".2f")])


def write_results(m: dict, results_dir: Path | None = None) -> None:
    results_dir = results_dir or paths.results_root()
    results_dir.mkdir(parents=True, exist_ok=True)
    write_csv(results_dir / "toggles.csv", csv_rows(m), CSV_COLUMNS)
    atomic_write(results_dir / "toggles.md", markdown(m))
    atomic_write_json(results_dir / "toggles.json", m, indent=1)


def benchmark_rows(quick: bool = False) -> list[dict]:
    """Efficiency toggles: AC memory/time, compile speedup and cold compile, Float8 deviation."""
    m = measure(quick)
    write_results(m)
    ac = {r["mode"]: r for r in m["ac"]}
    c, k = m["compile"], m["cold"]
    worst = max(m["float8"], key=lambda r: r["max_loss_diff"])
    return [
        {
            "benchmark": "toggles_ac_full_activation_ratio",
            "value": f"{ac['ac:full']['act_ratio']:.3f}",
            "unit": "ratio",
            "notes": f"peak activations full AC / no AC (goal < 0.5); step time x{ac['ac:full']['time_ratio']:.2f}",
        },
        {
            "benchmark": "toggles_compile_speedup",
            "value": f"{c['speedup']:.3f}",
            "unit": "ratio",
            "notes": f"eager / per-block compiled steady step, {c['shape']}; goal >= 1.2",
        },
        {
            "benchmark": "toggles_cold_compile_whole_over_block",
            "value": f"{k['whole_over_block_cpu']:.3f}",
            "unit": "ratio",
            "notes": f"cold compile CPU time whole model {k['whole_cold']['compile_cpu_s']:.1f} s / "
            f"per block {k['block_cold']['compile_cpu_s']:.1f} s "
            f"(wall {k['whole_over_block']:.2f}x); "
            f"per block on the warm cache {k['block_warm']['compile_s']:.1f} s wall",
        },
        {
            "benchmark": "toggles_float8_max_loss_diff",
            "value": f"{worst['max_loss_diff']:.3e}",
            "unit": "loss",
            "notes": f"worst recipe ({worst['recipe']}) vs bf16 over the steps; goal < 5e-3",
        },
    ]


@click.command("toggles-bench")
@click.option("--quick", is_flag=True, help="Smaller shapes (a smoke run, not the reported figures).")
def toggles_bench(quick):
    """Measure AC, regional compile and Float8 on the CPU proxy; write results/toggles.{md,csv,json}."""
    m = measure(quick)
    write_results(m)
    click.echo(markdown(m))
