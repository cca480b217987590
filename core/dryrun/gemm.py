"""What one GEMM costs on a GPU system, by its shape (M x K) @ (K x N) and its kernel family.

Kernel families (the kernels torch and torchao call):
- `bf16`: cuBLAS, bf16 in and out (every matmul without Float8, and Float8's high-precision ones);
- `fp8_tensorwise`: cuBLAS `_scaled_mm` with one scale per tensor (torchao's tensorwise recipe,
  and the rowwise recipes' gradient GEMMs, which torchao runs on this kernel with unit scales and
  rescales the output after, torchao/float8/float8_ops.py `addmm_float8_unwrapped`);
- `fp8_rowwise`: PyTorch's CUTLASS rowwise-scaled `_scaled_mm` (the rowwise recipes' forward).

A GEMM's time is the longest of its compute (FLOPs at the measured rate, times the spec's
sustained clock) and its HBM traffic (operands in, bf16 result out, at the streaming rate), plus
one kernel's fixed cost, as torchao's float8 roofline model prices it
(torchao/testing/training/roofline_utils.py `get_individual_gemm_time_sympy`). The compute rate
comes from the spec's measured points ([gemm.<kind>], core/dryrun/gpuspec.py): each point,
its fixed cost taken out, gives the rate of the kernel's tiles at that size; between points the
rate follows log(FLOPs), beyond them it is held, and it never falls as the GEMM grows (a larger
GEMM keeps every tile of a smaller one busy at least as long). So a smaller GEMM never runs at a
higher rate than a larger one of the same family: less work per operand byte and the same fixed
cost. A rowwise GEMM never outruns a tensorwise one of the same shape: it is the tensorwise
product plus a scale per row and per column in its epilogue (pytorch/pytorch#147971 measures it
at 90-100% of tensorwise, with a long tail down to 50%).
"""

from __future__ import annotations

import bisect
import functools
import math

from core.dryrun.gpuspec import GEMM_KINDS, GPUSpec

IN_BYTES = {"bf16": 2, "fp8_tensorwise": 1, "fp8_rowwise": 1}
OUT_BYTES = 2  # every training GEMM here writes bf16


class NoGemmRate(ValueError):
    """The spec has no measured GEMM rate for a kernel family the config needs."""


def peak(spec: GPUSpec, kind: str) -> float:
    return spec.peak_bf16_flops if kind == "bf16" else spec.peak_fp8_flops


@functools.cache
def _rate_table(spec: GPUSpec, kind: str) -> tuple[list[float], list[float]]:
    """(log2 FLOPs, tile rate in FLOP/s at the measuring part's clock) of the kind's points,
    ascending in FLOPs, the rate made non-decreasing."""
    if kind not in GEMM_KINDS:
        raise NoGemmRate(f"unknown GEMM kind {kind!r} (known: {', '.join(GEMM_KINDS)})")
    points = spec.gemm_points(kind)
    if not points:
        raise NoGemmRate(f"GPU spec {spec.name} has no measured GEMM rate for {kind} ([gemm.{kind}])")
    rows = []
    for p in points:
        flops = 2.0 * p.m * p.n * p.k
        measured_s = flops / (p.efficiency * peak(spec, kind))
        rows.append((flops, flops / max(measured_s - spec.kernel_overhead_s, 0.5 * measured_s)))
    rows.sort()
    xs, ys, best = [], [], 0.0
    for flops, rate in rows:
        best = max(best, rate)
        xs.append(math.log2(flops))
        ys.append(best)
    return xs, ys


def tile_rate(spec: GPUSpec, kind: str, flops: float) -> float:
    """FLOP/s of the kind's tiles for a GEMM of `flops` at the spec's sustained clock."""
    xs, ys = _rate_table(spec, kind)
    # rowwise: never faster than the tensorwise kernel it extends
    rate_tw = tile_rate(spec, "fp8_tensorwise", flops) / spec.clock_fraction if kind == "fp8_rowwise" else math.inf
    x = math.log2(max(flops, 1.0))
    i = bisect.bisect_left(xs, x)
    if i == 0:
        r = ys[0]
    elif i == len(xs):
        r = ys[-1]
    else:
        w = (x - xs[i - 1]) / (xs[i] - xs[i - 1])
        r = ys[i - 1] + w * (ys[i] - ys[i - 1])
    return min(r, rate_tw) * spec.clock_fraction


def gemm_seconds(spec: GPUSpec, m: float, n: float, k: float, kind: str, extra_bytes: float = 0.0) -> float:
    """Seconds of one (m x k) @ (k x n) GEMM of the kernel family `kind`; `extra_bytes`: HBM
    traffic of something running beside it (an AsyncTP copy) that competes for the same
    bandwidth."""
    if m <= 0 or n <= 0 or k <= 0:
        return 0.0
    flops = 2.0 * m * n * k
    compute = flops / tile_rate(spec, kind, flops)
    traffic = IN_BYTES[kind] * (m * k + k * n) + OUT_BYTES * m * n + extra_bytes
    return max(compute, traffic / (spec.hbm_bandwidth * spec.hbm)) + spec.kernel_overhead_s
