"""`run-recipe bench`: measure the trainer on this machine and rewrite results/benchmarks.csv.

Every figure is measured afresh in this run; ratios compare runs made in the same process, one
right after the other (timings on shared CPUs are noisy; ratios from one run are not).
Rows: trainer_vs_bare_loop (trainer tokens/s / bare PyTorch loop tokens/s, world 1), proxy_mfu
(fraction of the measured CPU bf16 matmul peak), fsdp_state_bytes_w{1,2,4} (parameters +
optimizer state held by one rank), plus the rows other benchmarks add (checkpoint, toggles).
"""

from __future__ import annotations

import statistics
import tempfile
from pathlib import Path

import click

from core.config import load_config
from core.reference import reference_run
from core.train import Trainer
from core.validate import validate
from recipes import modes, paths
from recipes.report.results import read_csv, write_csv
from recipes.studies import checkpoint_bench, toggles_bench
from recipes.studies.common import one_rank_group, synthetic_job

COLUMNS = ["benchmark", "value", "unit", "notes"]


def _bench_config(flavor: str, seq_len: int, batch: int, steps: int, dtype: str):
    cfg = load_config(
        None,
        synthetic_job(
            flavor, seq_len, batch, steps, f"--training.mixed_precision_param={dtype}", "--lr_scheduler.warmup_steps=1"
        ),
    )
    return validate(cfg, 1, check_files=False)


def trainer_vs_bare_loop(
    flavor: str = "small", seq_len: int = 256, batch: int = 4, steps: int = 6, rounds: int = 2, dtype: str = "bfloat16"
) -> dict:
    """Alternate the trainer and two bare loops `rounds` times in this process; median steady
    step times. The bare loops differ only in AdamW's kernels: fused, as the trainer's default
    (the ratio is then the trainer's own overhead), and foreach (PyTorch's multi-tensor path)."""
    cfg = _bench_config(flavor, seq_len, batch, steps, dtype)
    tokens = seq_len * batch
    trainer_times, bare_times, foreach_times, records = [], [], [], []
    with tempfile.TemporaryDirectory() as tmp, one_rank_group(cfg):
        cfg.job.output_dir = tmp
        for _ in range(rounds):
            rec = Trainer(cfg).train()
            records.append(rec)
            trainer_times += rec["step_times_s"][1:]
            bare_times += reference_run(cfg, adamw=cfg.optimizer.implementation)["step_times_s"][1:]
            foreach_times += reference_run(cfg)["step_times_s"][1:]
    t_trainer, t_bare = statistics.median(trainer_times), statistics.median(bare_times)
    rec = records[-1]
    return {
        "trainer_tokens_per_s": tokens / t_trainer,
        "bare_tokens_per_s": tokens / t_bare,
        "ratio": t_bare / t_trainer,
        "ratio_vs_foreach": statistics.median(foreach_times) / t_trainer,
        "mfu": rec["flops_per_token"] * tokens / t_trainer / rec["hardware"]["peak_flops"],
        "peak_flops": rec["hardware"]["peak_flops"],
        "params": rec["model"]["params"],
        "shape": f"{flavor} ({rec['model']['params'] / 1e6:.1f}M params), seq {seq_len}, batch {batch}, {dtype}",
    }


def fsdp_state_bytes(worlds=(1, 2, 4), flavor: str = "debug") -> dict[int, int]:
    """Parameter + optimizer bytes on rank 0 after 2 AdamW steps under FSDP2 at each world size."""
    out = {}
    for world in worlds:
        with tempfile.TemporaryDirectory() as tmp:
            rec = modes.launch_trainer(world, synthetic_job(flavor, 64, 2, 2), Path(tmp))
        out[world] = max(
            p + o for p, o in zip(rec["param_bytes_per_rank"], rec["optimizer_bytes_per_rank"], strict=True)
        )
    return out


def write_rows(rows: list[dict], path: Path | None = None) -> None:
    """Replace the rows this run measured in results/benchmarks.csv, keep the others (written by
    other benchmarks)."""
    path = path or paths.results_root() / "benchmarks.csv"
    names = {r["benchmark"] for r in rows}
    kept = [r for r in read_csv(path) if r["benchmark"] not in names]
    write_csv(path, kept + rows, COLUMNS)


@click.command("bench")
@click.option("--quick", is_flag=True, help="Smaller shapes (a smoke run, not the reported figures).")
def bench(quick: bool) -> None:
    """Measure trainer overhead, proxy MFU and FSDP2 memory per rank; rewrite results/benchmarks.csv."""
    rows = []
    shape = {"flavor": "debug", "steps": 3, "rounds": 1} if quick else {}
    click.echo("[bench] trainer vs bare PyTorch loop (world 1, same process) ...")
    r = trainer_vs_bare_loop(**shape)
    rows.append(
        {
            "benchmark": "trainer_vs_bare_loop",
            "value": f"{r['ratio']:.3f}",
            "unit": "ratio",
            "notes": f"trainer {r['trainer_tokens_per_s']:.0f} vs bare {r['bare_tokens_per_s']:.0f} tokens/s, "
            f"both with fused AdamW; {r['shape']}; median steady step; goal >= 1.0",
        }
    )
    rows.append(
        {
            "benchmark": "trainer_vs_bare_loop_foreach_adamw",
            "value": f"{r['ratio_vs_foreach']:.3f}",
            "unit": "ratio",
            "notes": f"the same trainer against the bare loop with foreach AdamW; {r['shape']}",
        }
    )
    rows.append(
        {
            "benchmark": "proxy_mfu",
            "value": f"{r['mfu']:.3f}",
            "unit": "fraction of measured peak",
            "notes": f"{r['shape']}; peak = measured bf16 matmul {r['peak_flops'] / 1e9:.0f} GFLOP/s; "
            "FLOPs/token = 6(N-N_emb)+12*L*H*(D/H)*T",
        }
    )
    click.echo(
        f"[bench] trainer/bare = {r['ratio']:.3f} (vs foreach AdamW {r['ratio_vs_foreach']:.3f}), MFU = {r['mfu']:.3f}"
    )
    click.echo("[bench] FSDP2 parameter+optimizer bytes per rank at world 1, 2, 4 ...")
    sizes = fsdp_state_bytes()
    for world, b in sizes.items():
        rows.append(
            {
                "benchmark": f"fsdp_state_bytes_w{world}",
                "value": str(b),
                "unit": "bytes",
                "notes": f"params + AdamW state on the largest rank, debug flavor, FSDP2 world {world}; "
                f"{sizes[1] / b:.2f}x less than world 1",
            }
        )
        click.echo(f"[bench]   world {world}: {b / 2**20:.1f} MiB")
    for extra in _extra_benchmarks():
        click.echo(f"[bench] {extra.__doc__.splitlines()[0] if extra.__doc__ else extra.__name__} ...")
        rows += extra(quick=quick)
    write_rows(rows)
    click.echo(f"[bench] wrote {paths.results_root() / 'benchmarks.csv'}")


def _extra_benchmarks():
    """Benchmarks other studies contribute (each `benchmark_rows(quick) -> rows in COLUMNS`)."""
    return [checkpoint_bench.benchmark_rows, toggles_bench.benchmark_rows]
