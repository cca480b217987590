"""Where one GPU's step goes: the one-device layout of `preflight --gpus 1` (8B's widths, seq 8192,
local batch 1, compiled, AC none) run by the trainer with its `[profiling]` window, then its op
table summed by kind of kernel, to set beside the performance model's breakdown.

  python scripts/gpu_profile_one.py run bf16|float8 OUT_DIR [--layers 8]   (on a CUDA GPU)
  python scripts/gpu_profile_one.py summarize OPS_CSV [--blocks 8]         (anywhere)
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import click

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

# Kernel name -> kind. Only device kernels count (the op table also lists the CPU-side ops and
# launchers that carry the same device time: counting them too would count it twice).
KINDS = (
    ("gemm", ("nvjet", "gemm", "cutlass")),
    ("attention (cuDNN SDPA)", ("sdpa", "flash", "cudnn")),
    ("optimizer + grad clip", ("multi_tensor",)),
    ("compiled blocks' fused kernels (triton)", ("triton",)),
)
NOT_KERNELS = ("aten::", "## ", "step ", "Optimizer", "autograd", "cuda", "torch", "Torch-Compiled", "c10d", "nccl")


def kind_of(kernel: str) -> str:
    for kind, marks in KINDS:
        if any(m in kernel.lower() for m in marks):
            return kind
    return "other (loss, casts and copies outside the blocks)"


def ms_by_kind(ops_csv: Path):
    """Device milliseconds per step of each kind of kernel (a pandas Series, largest first)."""
    import pandas as pd

    ops = pd.read_csv(ops_csv)
    kernels = ops[(ops.input_shapes == "[]") & ~ops.op.str.startswith(NOT_KERNELS)]
    return kernels.groupby(kernels.op.map(kind_of)).self_ms_per_step.sum().sort_values(ascending=False)


@click.group()
def main() -> None:
    pass


@main.command()
@click.argument("precision", type=click.Choice(["bf16", "float8"]))
@click.argument("out", type=click.Path(path_type=Path))
@click.option("--layers", default=8, show_default=True, help="blocks of 8B's widths")
def run(precision: str, out: Path, layers: int) -> None:
    """Five steps, steps 3-4 profiled; the op table goes to OUT/profile_<precision>_<layers>_blocks_ops.csv."""
    from recipes.gpu_spec.shapes import ONE_GPU, layout_config
    from recipes.studies.preflight_one import run_layout

    shape = (ONE_GPU["flavor"], ONE_GPU["seq"], ONE_GPU["local_batch"])
    cfg = layout_config(*shape, "none", n_layers=layers, compile_=True, float8=precision == "float8")
    cfg.profiling.enabled, cfg.profiling.start_step, cfg.profiling.steps = True, 3, 2
    cfg.profiling.record_shapes = True
    work = out / f"run_{precision}"
    times, mem = run_layout(cfg, 5, work)
    click.echo(f"{precision}: steady steps {[round(t, 4) for t in times]} s, peak reserved {mem:.3f} GiB")
    out.mkdir(parents=True, exist_ok=True)
    shutil.copy(work / "profile" / "rank0_ops.csv", out / f"profile_{precision}_{layers}_blocks_ops.csv")


@main.command()
@click.argument("ops_csv", type=click.Path(exists=True, path_type=Path))
def summarize(ops_csv: Path) -> None:
    """Milliseconds per step by kind of kernel, as a Markdown table."""
    by_kind = ms_by_kind(ops_csv)
    click.echo("| kind of kernel | ms per step |\n|---|---:|")
    for kind, ms in by_kind.items():
        click.echo(f"| {kind} | {ms:.1f} |")
    click.echo(f"| all kernels | {by_kind.sum():.1f} |")


if __name__ == "__main__":
    main()
