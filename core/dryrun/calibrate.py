"""The performance model's four fitted constants, refitted: `run-recipe dry-run-table --calibrate`
(which hands this module the configurations and measured figures: core never imports the
recipes). Every other number of core/dryrun/hardware/*.toml is a datasheet figure or a cited
measurement; the values are written into the spec files by hand, with a note naming the figure.

Both are sustained clocks: the clock a part holds through a training run, as a fraction of the
clock the spec's GEMM and attention rates were measured at (short microbenchmarks on 700 W
H100 / H200 parts). Neither is published for these systems:

- the paper's 500 W H100 (h100_96gb_hbm2e_500w), fitted on Table 1, FSDP + compile, 8 GPUs
  (llama3_8b/table1/8gpu_fsdp_compile: no exposed communication, and the paper (6,674) and its
  Dec 2024 re-run (6,667) agree);
- the 700 W Hopper parts (h100_sxm_80gb and h200_141gb share it: the same die at the same power
  limit), fitted on one public H100 SXM figure (results/perf_validation.md names it);
- the 400 W A100 SXM (a100_sxm_80gb), fitted on torchtitan's 1,000-step run on one node of 8
  (pytorch/torchtitan PR 355: no network between nodes, the config pinned, steady readings);
- the 750 W MI300X (mi300x; not the 1000 W MI325X, whose clock differs), fitted on the one public torchtitan run on
  an AMD GPU with its configuration stated (torchao's float8 README, bf16 on 8 MI300X): it also
  absorbs what the spec's borrowed rates miss there (torch's ROCm attention kernels, the GEMMs of
  the real shapes).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True)
class Fit:
    field: str  # the GPUSpec field
    specs: tuple[str, ...]  # the spec files that hold it
    figure: str  # the public figure it is fitted on (results/perf_validation.md)
    row: str  # the recipe row the figure's configuration starts from


FITS = (
    Fit(
        "clock_fraction",
        ("h100_96gb_hbm2e_500w",),
        "paper/llama3_8b/table1/8gpu_fsdp_compile",
        "llama3_8b/table1/8gpu_fsdp_compile",
    ),
    Fit("clock_fraction", ("h100_sxm_80gb", "h200_141gb"), "aws-p5/8b-32-eager", "llama3_8b/table1/128gpu_fsdp"),
    Fit("clock_fraction", ("a100_sxm_80gb",), "tt355/8b-8-a100-eager", "llama3_8b/table1/8gpu_fsdp"),
    Fit("clock_fraction", ("mi300x",), "aomi300x/8b-8-bf16", "llama3_8b/table1/8gpu_fsdp_compile"),
)


def fitted_figures() -> list[str]:
    return [f.figure for f in FITS]


def describe() -> list[str]:
    """One line per fitted constant: which spec field, on which figure."""
    return [f"compute.{f.field} of {' and '.join(f.specs)} on {f.figure}" for f in FITS]


def _bisect(f, lo: float, hi: float, iters: int = 40) -> float:
    """x in [lo, hi] where the increasing function f crosses 0."""
    for _ in range(iters):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if f(mid) < 0 else (lo, mid)
    return (lo + hi) / 2


def fit(targets: dict[str, tuple[object, float, object]]) -> dict[str, float]:
    """targets: for each fitted figure id, (its validated config, its measured TPS/GPU, the
    software stack that ran it, core/dryrun/stack.py). Each
    constant is fitted on its figure alone (a clock changes only its own specs); returns them by
    figure id, rounded as stored."""
    from core.dryrun.gpuspec import load_spec
    from core.dryrun.runtime import predict

    mem = {"allocated_peak_gib": 0.0}  # memory is not what is fitted
    out = {}
    for f in FITS:
        cfg, measured, stack = targets[f.figure]
        spec = load_spec(f.specs[0])

        def err(x, f=f, cfg=cfg, measured=measured, spec=spec, stack=stack):
            s = dataclasses.replace(spec, **{f.field: x})
            return predict(cfg, s, memory=mem, stack=stack)["tokens_per_sec_per_gpu"] - measured

        out[f.figure] = round(_bisect(err, 0.05, 1.0), 3)
    return out
