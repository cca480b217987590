"""`run-recipe gpu-spec --measure [--out FILE]`: measure the device that is present and write its
GPU spec, which `--gpu FILE` then takes wherever a spec name is taken (`run-recipe run --mode
dry-run`, `run-recipe plan`, `run-recipe dry-run-table`). docs/gpu-spec.md says what each number is.

Exit codes: 0 written; 2 a bad option; 3 the device cannot run a benchmark asked for (one line
naming it and why; nothing written).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import click

from core.dryrun.gpuspec import GEMM_KINDS
from recipes import paths
from recipes.options import check_writable, out_file_option, refuse

EXIT_CANNOT = 3


def measure_spec(
    device: str = "auto",
    quick: bool = False,
    kinds: tuple[str, ...] | None = None,
    base: str | None = None,
    name: str | None = None,
    threads: int | None = None,
    progress=print,
    reuse_collectives: dict | None = None,
):
    """Measure and assemble (nothing written): (spec text, GPUSpec, Measurements). CannotMeasure
    names the benchmark the device cannot run. `reuse_collectives`: see run.measure_all."""
    from recipes.gpu_spec.assemble import default_name, spec_document
    from recipes.gpu_spec.device import CannotMeasure, base_spec, select_device
    from recipes.gpu_spec.run import measure_all

    dev = select_device(device, threads)
    base = base or base_spec(dev)
    if dev.kind == "cuda" and base is None and not reuse_collectives:
        import torch

        if torch.cuda.device_count() < 2:
            raise CannotMeasure(
                f"collectives: one GPU here and no shipped spec of {dev.name} to take the links from "
                "(pass --base NAME of a spec with this node's network)"
            )
    progress(
        f"measuring {dev.name} (torch {dev.torch_version}, {dev.driver})"
        + (f"; datasheet and network from {base}" if base else "")
    )
    m = measure_all(dev, quick, kinds, progress, reuse_collectives)
    text, spec = spec_document(m, name or default_name(m), base)
    return text, spec, m


def check_places(out: str | None, base: str | None, name: str | None) -> None:
    """What the spec is written to and read from, checked before minutes of measuring: --name a
    plain file name (it names runs/gpu_spec/<name>.toml), --base a spec that loads, --out's
    folder writable. One line and exit 2 otherwise."""
    from core.dryrun.gpuspec import SpecError, load_spec

    if name is not None and (not name or Path(name).name != name or name in (".", "..") or "\\" in name):
        refuse(f"error: --name {name!r}: a spec name is a plain file name (no folders: it names <name>.toml)")
    if base is not None:
        try:
            load_spec(base)
        except SpecError as e:
            refuse(f"error: --base: {e}")
    check_writable("--out", Path(out).parent if out else paths.default_runs_dir() / "gpu_spec")


@click.command("gpu-spec")
@click.option("--measure", is_flag=True, required=True, help="Run the microbenchmarks on the device present.")
@out_file_option("Spec file to write (default: runs/gpu_spec/<name>.toml).")
@click.option("--device", type=click.Choice(["auto", "cuda", "cpu"]), default="auto", show_default=True)
@click.option(
    "--gemm",
    "kinds",
    multiple=True,
    type=click.Choice(GEMM_KINDS),
    help="GEMM kernel families to measure (repeatable; default: every one the device runs, the others "
    "skipped with the reason). One the device lacks is refused.",
)
@click.option("--base", default=None, metavar="NAME", help="Spec whose datasheet and network figures to keep.")
@click.option("--name", default=None, help="The spec's name (default: measured_<device>).")
@click.option("--threads", type=int, default=None, help="CPU: intra-op threads of the measured process.")
@click.option("--quick", is_flag=True, help="Fewer shapes and repeats, smaller sizes (seconds; for tests).")
def gpu_spec(measure, out, device, kinds, base, name, threads, quick):
    """Measure the device present (GEMMs at the model's shapes, SDPA, streaming, collectives) into
    a GPU spec that --gpu FILE accepts."""
    from core.dryrun.gpuspec import SpecError
    from core.fileio import atomic_write
    from recipes.gpu_spec.device import CannotMeasure

    if threads is not None and threads < 1:
        raise click.BadParameter(f"{threads}: at least 1 thread", param_hint="--threads")
    check_places(out, base, name)
    t0 = time.perf_counter()
    try:
        text, spec, m = measure_spec(device, quick, tuple(kinds) or None, base, name, threads, click.echo)
    except CannotMeasure as e:
        click.echo(f"error: cannot measure: {e}; no spec written", err=True)
        sys.exit(EXIT_CANNOT)
    except SpecError as e:
        raise click.BadParameter(str(e), param_hint="--base") from None
    path = Path(out) if out else paths.default_runs_dir() / "gpu_spec" / f"{spec.name}.toml"
    atomic_write(path, text)
    click.echo(
        f"wrote {path} ({spec.name}) in {time.perf_counter() - t0:.0f} s: bf16 peak "
        f"{spec.peak_bf16_flops / 1e12:.3g} TFLOP/s, {sum(len(p) for _, p in spec.gemm)} GEMM points, "
        f"bandwidth {spec.hbm_bandwidth * spec.hbm / 1e9:.3g} GB/s; use it with --gpu {path}"
    )
