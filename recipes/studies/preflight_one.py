"""`run-recipe preflight --gpus 1`: measure the device, write its spec, predict a one-device
training step with the performance model (core/dryrun/runtime.py, core/dryrun/memory.py) on
that spec, run the step with the trainer and compare: the whole path measure -> spec -> predict
-> compare, and a check of the model's structure (its compute / memory-bound split, its
recompute under each AC mode) on the device at hand.

- CUDA: the one-GPU layout: an 8B-shaped model with as many of its blocks as fit the GPU, seq
  8192, compiled, bf16 and Float8 tensorwise, each AC mode; predicted on the GPU's shipped spec
  (when there is one) and on the spec just measured. Peak memory: CUDA's max reserved against
  the estimate with the allocator's gap.
- CPU: the proxy (recipes/gpu_spec/shapes.py PROXY) in one process, bf16 (autocast, the trainer's
  bf16 GEMM route core/cpu_gemm.py), eager, each AC mode, on the CPU spec just measured. Peak
  memory: the tensors' peak as torch's MemTracker counts it against the estimate's allocated
  peak (a CPU has no caching allocator). Float8 is skipped: a CPU has no float8 matmul.

A shared machine's load moves both measurements, so they alternate: each round measures the
spec, then runs every AC mode's steps against it; the spread over rounds is reported. No constant
is fitted to the step: the prediction reads only the spec measured in the same round.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import statistics
import time
from pathlib import Path

import click

from core.fileio import atomic_write, atomic_write_json

AC_MODES = ("none", "full", "selective")
TARGET = 0.25  # the goal: predicted within 25% of the measured step time (bf16)


@dataclasses.dataclass
class Run:
    """One layout's steps on the device, measured and predicted (on each spec, by label)."""

    label: str  # e.g. "bf16, AC none"
    precision: str
    ac: str
    step_s: list[float]  # steady steps (the first one, lazy init and compile, left out)
    memory_gib: float
    predicted_s: dict[str, float]
    predicted_gib: float
    load: float  # the machine's 1-minute load average after the steps (a shared machine's share)

    @property
    def measured_s(self) -> float:
        return statistics.median(self.step_s)

    def error(self, spec_label: str) -> float:
        return self.predicted_s[spec_label] / self.measured_s - 1


def _peak_tensor_gib(trainer, batch) -> float:
    """The tensors' peak over one step as torch's MemTracker counts it (a CPU has no allocator
    statistics; the process's RSS also holds torch's own libraries)."""
    from torch.distributed._tools.mem_tracker import _TOTAL_KEY, MemTracker

    tracker = MemTracker()
    tracker.track_external(*trainer.model_parts, trainer.optimizer)
    with tracker:
        trainer.train_step([batch])
    peak = tracker.get_tracker_snapshot("peak")
    return max(v[_TOTAL_KEY] for v in peak.values()) / 2**30


def run_layout(cfg, steps: int, out: Path) -> tuple[list[float], float]:
    """The trainer's own loop (core.train.Trainer) for `steps` steps in this process: the steady
    step times, and the peak memory (CUDA: max reserved over the steady steps, the paper's
    figure; CPU: the tensors' peak of one more step). On CUDA the caching allocator is emptied
    first: what it kept from the layout before would count as this one's reserved memory."""
    import gc

    import torch

    from core.train import Trainer, init_distributed
    from core.validate import validate

    cfg.training.steps = steps
    cfg.job.output_dir = str(out)
    cfg.job.mode = "proxy" if not torch.cuda.is_available() else "real"
    cfg.metrics.progress = False
    cfg = validate(cfg, 1, check_files=False)
    init_distributed(cfg)
    if torch.cuda.is_available():
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    trainer = Trainer(cfg)
    record = trainer.train()
    times = record["step_times_s"][1:]
    if torch.cuda.is_available():
        return times, record["peak_memory_gib"]
    return times, _peak_tensor_gib(trainer, next(iter(trainer.dataloader)))


def predicted(cfg, specs: dict, capacity_gib: float) -> tuple[dict[str, float], float, float]:
    """(step seconds on each spec, allocated peak GiB, estimated reserved GiB) of the config."""
    from core.dryrun.memory import estimate_memory
    from core.dryrun.runtime import predict
    from core.validate import validate

    cfg = validate(cfg, 1, check_files=False)
    mem = estimate_memory(cfg, gpu_gib=capacity_gib)
    steps = {label: predict(cfg, spec, memory=mem)["step_time_s"] for label, spec in specs.items()}
    return steps, mem["allocated_peak_gib"], mem["estimated_peak_gib"]


def one_device_options(command):
    """`run-recipe preflight`'s options of this form (--gpus 1 and what it takes)."""
    options = [
        click.option(
            "--gpus",
            type=int,
            default=None,
            help="1: measure this device, predict a one-device step on its spec, run it and compare "
            "(recipes/studies/preflight_one.py); without it, the node's feature check.",
        ),
        click.option(
            "--device",
            type=click.Choice(["auto", "cuda", "cpu"]),
            default="auto",
            show_default=True,
            help="--gpus 1: the device (cuda: the GPU form, refused without one).",
        ),
        click.option("--quick", is_flag=True, help="--gpus 1: the tests' sizes (seconds)."),
    ]
    counts = (
        ("--rounds", 1, 2, "measure-then-run rounds"),
        ("--steps", 2, 6, "steps per run, the first one a warm-up"),
        ("--threads", 1, 1, "threads on a CPU, measured and run alike"),
        ("--layers", 0, 0, "blocks of the GPU form's 8B-shaped model (0: the most whose estimate fits)"),
    )
    options[2:2] = [
        click.option(name, type=click.IntRange(low), default=default, show_default=True, help=f"--gpus 1: {what}.")
        for name, low, default, what in counts
    ]
    for option in reversed(options):
        command = option(command)
    return command


# ------------------------------------------------------------------------------------ the forms
def _layouts(m, capacity: float, quick: bool, echo, layers: int = 0) -> list[tuple[str, str, object]]:
    """(precision, AC mode, config) of each run: the CPU proxy in bf16; on a GPU the one-GPU
    layout (8B's widths with the most blocks, of 32, whose estimate without AC fits the GPU;
    compiled) in bf16 and, where the GPU runs float8 matmuls, Float8 tensorwise."""
    from core.dryrun.memory import allocator_gap, estimate_memory
    from core.validate import validate
    from recipes.gpu_spec.shapes import ONE_GPU, PROXY, PROXY_QUICK, layout_config

    precisions = ["bf16"]
    if "fp8_tensorwise" in m.gemm:
        precisions.append("float8 tensorwise")
    else:
        echo(f"  SKIP  Float8 tensorwise: {m.skipped.get('fp8_tensorwise', 'not measured')}")
    if m.device.kind == "cpu":
        p = PROXY_QUICK if quick else PROXY
        return [("bf16", ac, layout_config(p["flavor"], p["seq"], p["local_batch"], ac)) for ac in AC_MODES]

    def cfg(layers: int, ac: str, float8: bool):
        c = layout_config(ONE_GPU["flavor"], ONE_GPU["seq"], 1, ac, n_layers=layers, compile_=True, float8=float8)
        return validate(c, 1, check_files=False)

    def fits(layers: int) -> bool:  # as plan counts it: the allocator's usual slack on top
        est = estimate_memory(cfg(layers, "none", False), capacity)
        return est["allocated_peak_gib"] + allocator_gap(est["allocated_peak_gib"]) <= capacity

    layers = layers or max((n for n in range(1, 33) if fits(n)), default=1)
    echo(f"  the one-GPU layout: {ONE_GPU['flavor']}'s widths, {layers} of its blocks, seq {ONE_GPU['seq']}")
    return [(prec, ac, cfg(layers, ac, prec != "bf16")) for prec in precisions for ac in AC_MODES]


def compare(
    out: Path, rounds: int, steps: int, quick: bool, threads: int | None, device: str, layers: int = 0, echo=click.echo
) -> dict:
    """Every round: measure the spec (write it), then run and predict each layout against it.
    Returns the summary written to out/comparison.json."""
    from recipes.gpu_spec.command import measure_spec

    runs: list[Run] = []
    specs_written = []
    reused = None
    for r in range(1, rounds + 1):
        echo(f"round {r}/{rounds}: measuring the device")
        text, spec, m = measure_spec(device, quick, None, None, None, threads, echo, reuse_collectives=reused)
        reused = m.collectives  # links do not enter a one-device step: measured once
        path = out / f"spec_round{r}.toml"
        atomic_write(path, text)
        specs_written.append(str(path))
        specs = {"measured": spec}
        if m.device.kind == "cuda":
            from recipes.gpu_spec.device import base_spec

            shipped = base_spec(m.device)
            if shipped:
                specs[shipped] = shipped
        for prec, ac, cfg in _layouts(m, spec.hbm_capacity_gib, quick, echo if r == 1 else lambda _: None, layers):
            pred, alloc_gib, reserved_gib = predicted(cfg, specs, spec.hbm_capacity_gib)
            t = time.perf_counter()
            times, mem = run_layout(cfg, steps, out / f"round{r}_{prec.replace(' ', '_')}_{ac}")
            run = Run(
                f"{prec}, AC {ac}",
                prec,
                ac,
                times,
                mem,
                pred,
                reserved_gib if m.device.kind == "cuda" else alloc_gib,
                os.getloadavg()[0],
            )
            runs.append(run)
            echo(
                f"  {run.label}: measured {run.measured_s:.3f} s/step ({len(times)} steps, "
                f"{time.perf_counter() - t:.0f} s), predicted {pred['measured']:.3f} ({run.error('measured'):+.1%}); "
                f"memory {mem:.3f} GiB, predicted {run.predicted_gib:.3f}; load average {run.load:.1f}"
            )
    return _summary(runs, specs_written, m.device.name)


def _spread(xs: list[float], fmt: str) -> str:
    med = format(statistics.median(xs), fmt)
    return med if len(xs) == 1 else f"{med} [{format(min(xs), fmt)}, {format(max(xs), fmt)}]"


def _summary(runs: list[Run], specs: list[str], device: str) -> dict:
    """Per layout, over the rounds: measured and predicted step and memory, the errors; the
    verdict: every bf16 layout's median error within TARGET on the measured spec."""
    layouts: dict[str, dict] = {}
    for run in runs:
        d = layouts.setdefault(run.label, {"precision": run.precision, "ac": run.ac})
        for key, value in (
            ("measured_s", run.measured_s),
            ("steps_s", run.step_s),
            ("memory_gib", run.memory_gib),
            ("predicted_gib", run.predicted_gib),
            ("load", run.load),
        ):
            d.setdefault(key, []).append(value)
        for spec in run.predicted_s:
            d.setdefault("predicted_s", {}).setdefault(spec, []).append(run.predicted_s[spec])
            d.setdefault("error", {}).setdefault(spec, []).append(run.error(spec))
    misses = [
        f"{label}: {statistics.median(d['error']['measured']):+.1%}"
        for label, d in layouts.items()
        if d["precision"] == "bf16" and abs(statistics.median(d["error"]["measured"])) > TARGET
    ]
    from core.result import versions  # torch, python, torchao, the git commit

    return {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "device": device,
        "versions": versions(),
        "specs": specs,
        "target": TARGET,
        "layouts": layouts,
        "misses": misses,
        "passed": not misses,
    }


def comparison_table(summary: dict) -> str:
    from tabulate import tabulate

    rows = []
    spec_labels = sorted(
        {s for d in summary["layouts"].values() for s in d["predicted_s"]}, key=lambda s: s != "measured"
    )
    for label, d in summary["layouts"].items():
        row = [label, _spread(d["measured_s"], ".3f")]
        for s in spec_labels:
            row += [_spread(d["predicted_s"][s], ".3f"), _spread(d["error"][s], "+.1%")]
        mem_err = [p / m - 1 for p, m in zip(d["predicted_gib"], d["memory_gib"], strict=True)]
        row += [_spread(d["memory_gib"], ".3f"), _spread(d["predicted_gib"], ".3f"), _spread(mem_err, "+.1%")]
        rows.append(row)
    headers = ["layout", "measured s/step"]
    for s in spec_labels:
        headers += [f"predicted ({s} spec)", "error"]
    headers += ["peak GiB measured", "predicted", "error"]
    return tabulate(rows, headers=headers)


def one_device(
    out: Path, rounds: int, steps: int, quick: bool, threads: int | None, device: str, layers: int = 0
) -> int:
    """The command's body: the comparison printed and written (out/comparison.json); exit 0 when
    every bf16 layout is predicted within TARGET, 1 when not, 3 when the device cannot be measured."""
    from recipes.gpu_spec.device import CannotMeasure

    out.mkdir(parents=True, exist_ok=True)
    click.echo(f"preflight --gpus 1 in {out}: measure the device -> spec -> predict -> run -> compare")
    t0 = time.perf_counter()
    try:
        summary = compare(out, rounds, steps, quick, threads, device, layers)
    except CannotMeasure as e:
        click.echo(f"error: cannot measure: {e}; nothing run", err=True)
        return 3
    summary["wall_s"] = time.perf_counter() - t0
    atomic_write_json(out / "comparison.json", summary)
    click.echo("\n" + comparison_table(summary))
    if quick:
        click.echo(
            "  INFO  --quick sizes: a step of milliseconds is per-op overhead the model does not price; "
            f"no accuracy verdict (the {TARGET:.0%} goal is the full proxy's) ({out / 'comparison.json'})"
        )
        return 0
    verdict = "PASS" if summary["passed"] else "FAIL"
    detail = "; ".join(summary["misses"]) or "every bf16 layout"
    click.echo(
        f"  {verdict}  predicted step within {TARGET:.0%} of the measured one (median over {rounds} rounds, "
        f"spec measured in the same round, nothing fitted): {detail}"
        f" ({summary['wall_s']:.0f} s; {out / 'comparison.json'})"
    )
    return 0 if summary["passed"] else 1
