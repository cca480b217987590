"""One transformer block's linear layers and what each costs under each precision recipe: the
GEMMs of forward and backward (core/dryrun/gemm.py, at their own shapes, TP shards included) and
the HBM traffic of Float8's casts.

Recipes, as torchao 0.18 runs them (torchao/float8/config.py `recipe_name_to_linear_config`,
float8_ops.py `addmm_float8_unwrapped`):
- `bf16`: three bf16 GEMMs (output, grad input, grad weight);
- `tensorwise`: three cuBLAS fp8 GEMMs; one scale per tensor;
- `rowwise`: the output GEMM on the CUTLASS rowwise kernel (fast accumulation); the two gradient
  GEMMs, which use slow accumulation, on the cuBLAS tensorwise kernel with unit scales and a
  separate rescaling kernel after (pytorch/ao#2184: an extra kernel per GEMM); every operand is
  scaled per row, and again along the other dimension for the transposes backward needs;
- `rowwise_with_gw_hp`: the output GEMM rowwise, grad input on cuBLAS fp8 + rescale, grad weight
  in bf16; inputs and gradients scaled along one dimension only.
An unknown recipe is refused, never priced as another.

Where the spec has a measured grid of a recipe's whole-linear speedup ([float8_linear.<recipe>],
core/dryrun/gpuspec.py), a linear is never priced faster than it: the model prices the grid's
microbenchmark at the linear's shape both ways, and the time by which its own Float8 side beats
the measured ratio is added to the linear's GEMMs (`measured_excess`). Torchao's H100 grid
shows rowwise's small-N linears at half bf16's speed, which no roofline term here explains.

Cast traffic per element, compiled, from torchao's float8 roofline model (torchao/testing/training/
roofline_utils.py `get_tensor_memory_traffic_ovhd_s`): a tensor's amax pass can fuse into the op
that produced it (its `fuse_with_prev`); a weight's cannot (FSDP's all-gather produces it). The
three linears reading one input (wq, wk, wv; w1, w3) cast it once: AOTAutograd's
common-subexpression elimination merges the identical casts of a compiled block. With Float8's
TP styles (tensorwise) an input or output gradient is cast on its sequence shard before the
float8 all-gather, then transposed once gathered; with the FSDP float8 all-gather a weight
arrives cast, leaving its transpose.

Eager, nothing fuses and nothing is shared: each linear casts its own input, weight and output
gradient, and each cast is the separate kernels torchao's code runs (`EAGER_CAST_BYTES`), plus
the fp8 copies `_scaled_mm`'s layout needs in backward (`eager_cast_bytes`).
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass

from core.dryrun.activations import Shapes, shapes
from core.dryrun.gemm import gemm_seconds
from core.dryrun.gpuspec import GPUSpec, LinearSpeedups
from core.dryrun.stack import THIS_TRAINER, Stack
from core.models.args import model_args

RECIPES = ("bf16", "tensorwise", "rowwise", "rowwise_with_gw_hp")
# GEMM kernel family of (output, grad input, grad weight) per recipe
GEMMS = {
    "bf16": ("bf16", "bf16", "bf16"),
    "tensorwise": ("fp8_tensorwise", "fp8_tensorwise", "fp8_tensorwise"),
    "rowwise": ("fp8_rowwise", "fp8_tensorwise", "fp8_tensorwise"),
    "rowwise_with_gw_hp": ("fp8_rowwise", "fp8_tensorwise", "bf16"),
}
# torchao's roofline, HBM bytes per element of one cast, (unfused, fused with its producer):
# an input (forward) or an output gradient (backward).
ACT_CAST = {
    "tensorwise": (6, 4),  # amax read 2 (fused: 0); one pass reading 2, writing both fp8 layouts 1 + 1
    "rowwise": (8, 6),  # dim0 cast + bf16 transpose 2 + 1 + 2 (fused: 1 + 2); dim1 cast 2 + 1
    "rowwise_with_gw_hp": (3, 1),  # dim0 cast only: 2 + 1 (fused: 1)
}
# A weight's casts (forward, backward): never fused (FSDP's all-gather produces it).
WEIGHT_CAST = {"tensorwise": (5, 3), "rowwise": (3, 7), "rowwise_with_gw_hp": (3, 3)}
# One eager cast of a bf16 tensor, HBM bytes per element and kernels, as torchao runs it
# (pytorch/ao torchao/float8 at 8c81863ba, the code of the Jan-Mar 2025 runs; unchanged in 0.18):
# the amax, `torch.max(torch.abs(x))` (float8_utils.py tensor_to_amax: abs reads 2 and writes 2,
# max reads 2), four scalar kernels to a scale (amax_to_scale), then the cast,
# `x.to(torch.float32) * scale` (float8_tensor.py _ToFloat8ConstrFunc: 2 + 4, 4 + 4) and
# `to_fp8_saturated`: clamp (4 + 4), `.to(float8)` (4 + 1).
EAGER_CAST_BYTES = 33
EAGER_CAST_KERNELS = 10
# Eager casts per linear: (input, weight) forward; (output gradient, input, weight) backward
# (torchao float8_linear.py matmul_with_hp_or_float8_args: backward casts the output gradient for
# grad input and again along the other dimension for grad weight, and recasts the saved bf16
# input; tensorwise reuses the saved fp8 weight; rowwise scales it along its other dimension;
# with a high-precision grad weight neither the input nor the second gradient cast runs).
EAGER_CASTS = {"tensorwise": (1, 1, 2, 1, 0), "rowwise": (1, 1, 2, 1, 1), "rowwise_with_gw_hp": (1, 1, 1, 0, 1)}
# ... and the operands `_scaled_mm` needs in the other layout, copied in fp8 (float8_ops.py
# preprocess_addmm): the saved weight's transpose for grad input; for an fp8 grad weight, the
# output gradient's and the input's.
EAGER_TRANSPOSED = {
    "tensorwise": ("weight", "grad", "input"),
    "rowwise": ("weight", "grad", "input"),
    "rowwise_with_gw_hp": ("weight",),
}
RESCALE_BYTES = 4  # the rescaling kernel after a slow-accumulation rowwise GEMM reads and writes bf16
FP8_TRANSPOSE_BYTES = 2  # a gathered fp8 tensor copied to the other layout
# The microbenchmark behind a [float8_linear] grid (torchao benchmarks/float8/float8_roofline.py):
# LayerNorm -> Linear -> Sigmoid, forward + backward, compiled. HBM bytes per element of the
# norm's input (and of the sigmoid's output): forward reads and writes bf16 (4), backward reads
# the input and the gradient and writes a gradient (6).
BENCH_POINTWISE_BYTES = 10


@dataclass(frozen=True)
class Linear:
    name: str
    k: int  # local input features
    n: int  # local output features
    group: str  # linears that read the same input
    k_full: int
    n_full: int


def block_linears(s: Shapes) -> tuple[Linear, ...]:
    """wq, wk, wv, wo, w1, w3, w2 with their local (TP-sharded) widths."""
    t = s.tp
    return (
        Linear("wq", s.d, s.q, "attention", s.d, s.q * t),
        Linear("wk", s.d, s.kv, "attention", s.d, s.kv * t),
        Linear("wv", s.d, s.kv, "attention", s.d, s.kv * t),
        Linear("wo", s.q, s.d, "wo", s.q * t, s.d),
        Linear("w1", s.d, s.f, "ffn", s.d, s.f * t),
        Linear("w3", s.d, s.f, "ffn", s.d, s.f * t),
        Linear("w2", s.f, s.d, "w2", s.f * t, s.d),
    )


GemmShape = tuple[float, float, float]  # (m, n, k)


def linear_gemm_shapes(tokens: float, n: float, k: float) -> tuple[GemmShape, GemmShape, GemmShape]:
    """(m, n, k) of a linear's forward, grad input and grad weight GEMMs for `tokens` rows."""
    return (tokens, n, k), (tokens, k, n), (n, k, tokens)


def model_gemms(cfg) -> list[GemmShape]:
    """(m, n, k), whole numbers, of every distinct GEMM of one microbatch as the model prices it: each block
    linear's forward, grad input and grad weight at their TP-local widths (`gemms`), and the
    output projection's three (core/dryrun/runtime.py `head_times`). `run-recipe gpu-spec
    --measure` measures these shapes."""
    s = shapes(cfg)
    T, V = s.tokens, model_args(cfg, None).vocab_size // s.tp
    out = list(linear_gemm_shapes(T, V, s.d))
    for lin in block_linears(s):
        out += linear_gemm_shapes(T, lin.n, lin.k)
    return sorted(set(out))


class NoFloat8(ValueError):
    """Float8 on a GPU with no FP8 tensor cores (a spec without compute.peak_fp8_flops)."""


def recipe_of(cfg, spec: GPUSpec | None = None) -> str:
    """The precision recipe of the block linears; ValueError for one the model has no costs for,
    NoFloat8 for Float8 on a GPU spec without FP8 tensor cores."""
    if not cfg.float8.enabled:
        return "bf16"
    if spec is not None and not spec.peak_fp8_flops:
        cc = f" (compute capability {spec.compute_capability})" if spec.compute_capability else ""
        raise NoFloat8(
            f"float8.enabled: GPU spec {spec.name}{cc} has no FP8 tensor cores, so there is no float8 matmul "
            "to run or price: torchao's Float8 training needs compute capability 8.9 or later (Ada, Hopper, "
            "Blackwell; core/toggles/float8.py)"
        )
    r = cfg.float8.recipe
    if r not in GEMMS:
        raise ValueError(f"float8.recipe={r!r}: the performance model has no costs for it (known: {RECIPES[1:]})")
    return r


def converted(lin: Linear) -> bool:
    """Float8 converts a linear whose every dimension (and TP shard) is a multiple of 16
    (core/toggles/float8.py `module_filter`)."""
    return all(x % 16 == 0 for x in (lin.k, lin.n, lin.k_full, lin.n_full))


def gemm_kinds(lin: Linear, recipe: str) -> tuple[str, str, str]:
    return GEMMS[recipe if converted(lin) else "bf16"]


def gemms(spec: GPUSpec, tokens: float, lin: Linear, recipe: str) -> tuple[float, float]:
    """(forward, backward) seconds of the linear's GEMMs for `tokens` rows, with the time a
    measured grid adds (`measured_excess`)."""
    out, g_in, g_w = gemm_kinds(lin, recipe)
    f, gi, gw = linear_gemm_shapes(tokens, lin.n, lin.k)
    ex_f, ex_b = measured_excess(spec, tokens, lin, recipe)
    fwd = gemm_seconds(spec, *f, out) + ex_f
    bwd = gemm_seconds(spec, *gi, g_in) + gemm_seconds(spec, *gw, g_w) + ex_b
    return fwd, bwd


def _log_interp(axis: tuple[int, ...], x: float) -> tuple[int, int, float]:
    """Neighbouring indices and weight of x on an ascending axis, in log2, held beyond its ends."""
    if len(axis) == 1:
        return 0, 0, 0.0
    x = min(max(x, axis[0]), axis[-1])
    j = min(max(bisect.bisect_left(axis, x), 1), len(axis) - 1)
    lo, hi = math.log2(axis[j - 1]), math.log2(axis[j])
    return j - 1, j, (math.log2(x) - lo) / (hi - lo)


def table_speedup(t: LinearSpeedups, m: float, k: float, n: float) -> float:
    """The grid's speedup at (m, k, n): trilinear in log2 of each dimension, held beyond the grid."""
    (m0, m1, wm), (k0, k1, wk), (n0, n1, wn) = (_log_interp(a, x) for a, x in ((t.m, m), (t.k, k), (t.n, n)))
    total = 0.0
    for i, a in ((m0, 1 - wm), (m1, wm)):
        for j, b in ((k0, 1 - wk), (k1, wk)):
            for c, w in ((n0, 1 - wn), (n1, wn)):
                total += a * b * w * t.speedup[i * len(t.k) + j][c]
    return total


def _bench_seconds(spec: GPUSpec, m: float, k: float, n: float, recipe: str) -> tuple[float, float, float]:
    """The grid's microbenchmark as the model prices it: (forward GEMM, backward GEMMs, the rest:
    norm, sigmoid and, under Float8, the casts and rescales of one compiled linear on its own)."""
    kinds = GEMMS[recipe]
    f, gi, gw = linear_gemm_shapes(m, n, k)
    fwd = gemm_seconds(spec, *f, kinds[0])
    bwd = gemm_seconds(spec, *gi, kinds[1]) + gemm_seconds(spec, *gw, kinds[2])
    nbytes = BENCH_POINTWISE_BYTES * (m * k + m * n)
    kernels = 4  # norm and sigmoid, forward and backward
    if recipe != "bf16":
        nbytes += ACT_CAST[recipe][1] * (m * k + m * n) + sum(WEIGHT_CAST[recipe]) * k * n
        rescale, extra = rescale_work(m, k, n, recipe)
        nbytes, kernels = nbytes + rescale, kernels + extra + 3  # + a cast per operand
    return fwd, bwd, nbytes / (spec.hbm_bandwidth * spec.hbm) + kernels * spec.kernel_overhead_s


def measured_excess(spec: GPUSpec, tokens: float, lin: Linear, recipe: str) -> tuple[float, float]:
    """(forward, backward) seconds the linear takes beyond its GEMMs' and casts' pricing under
    `recipe`, from the spec's measured grid of the recipe's linear speedup (0 without one): the
    bf16 microbenchmark's priced time over the measured speedup, less the Float8 side's priced
    time, split as the GEMMs' time is."""
    grid = spec.linear_speedups(recipe)
    if grid is None or not converted(lin):
        return 0.0, 0.0
    measured = sum(_bench_seconds(spec, tokens, lin.k, lin.n, "bf16")) / table_speedup(grid, tokens, lin.k, lin.n)
    fwd, bwd, rest = _bench_seconds(spec, tokens, lin.k, lin.n, recipe)
    excess = max(0.0, measured - (fwd + bwd + rest))
    return excess * fwd / (fwd + bwd), excess * bwd / (fwd + bwd)


def rescale_work(tokens: float, k: float, n: float, recipe: str) -> tuple[float, int]:
    """HBM bytes and kernels of the rescales after a linear's slow-accumulation rowwise GEMMs."""
    if recipe == "rowwise":
        return RESCALE_BYTES * (tokens * k + n * k), 2
    if recipe == "rowwise_with_gw_hp":
        return RESCALE_BYTES * tokens * k, 1
    return 0.0, 0


def eager_cast_bytes(s: Shapes, recipe: str, fp8_weights: bool, shard: int) -> tuple:
    """Eager: (forward, backward) HBM bytes of Float8's casts for one block and one microbatch,
    and the kernels they launch: every linear's own casts (EAGER_CASTS, EAGER_CAST_BYTES each),
    the fp8 transposes backward copies, the rescales; a weight the float8 all-gather brought is
    cast on its shard instead."""
    T, per = s.tokens, EAGER_CAST_BYTES
    fwd = bwd = 0.0
    kernels = [0, 0]
    for lin in block_linears(s):
        if not converted(lin):
            continue
        inp, wgt, grad_b, inp_b, wgt_b = EAGER_CASTS[recipe]
        w, x, g = lin.k * lin.n, T * lin.k, T * lin.n
        if fp8_weights:
            wgt, wgt_b = 0, 0
            fwd += w * per / shard
        fwd += per * (inp * x + wgt * w)
        sizes = {"weight": w, "grad": g, "input": x}
        bwd += per * (grad_b * g + inp_b * x + wgt_b * w)
        bwd += FP8_TRANSPOSE_BYTES * sum(sizes[t] for t in EAGER_TRANSPOSED[recipe])
        rescale, extra = rescale_work(T, lin.k, lin.n, recipe)
        bwd += rescale
        kernels[0] += EAGER_CAST_KERNELS * (inp + wgt + (1 if fp8_weights else 0))
        kernels[1] += EAGER_CAST_KERNELS * (grad_b + inp_b + wgt_b) + len(EAGER_TRANSPOSED[recipe]) + extra
    return fwd, bwd, tuple(kernels)


def cast_bytes(s: Shapes, recipe: str, compiled: bool, tp_fp8: bool, fp8_weights: bool, shard: int) -> tuple:
    """(forward, backward) HBM bytes of Float8's casts for one block and one microbatch, and the
    extra kernels (forward, backward) they launch (compiled: backward's rescales)."""
    if recipe == "bf16":
        return 0.0, 0.0, (0, 0)
    if not compiled:
        return eager_cast_bytes(s, recipe, fp8_weights, shard)
    T = s.tokens
    fwd = bwd = 0.0
    kernels = 0
    seen = set()
    fused = 1  # compiled: an activation's amax pass fuses into its producer
    for lin in block_linears(s):
        if not converted(lin):
            continue
        if lin.group not in seen:  # one cast per distinct input
            seen.add(lin.group)
            per = ACT_CAST[recipe][fused]
            gathered = tp_fp8 and lin.group in ("attention", "ffn")
            fwd += T * lin.k * (per / s.tp + FP8_TRANSPOSE_BYTES if gathered else per)
        w = lin.k * lin.n
        if fp8_weights:  # cast on the FSDP shard before the float8 all-gather, then transposed
            fwd += w * (sum(WEIGHT_CAST[recipe]) / shard + FP8_TRANSPOSE_BYTES)
        else:
            fwd += w * WEIGHT_CAST[recipe][0]
            bwd += w * WEIGHT_CAST[recipe][1]
        per = ACT_CAST[recipe][fused]
        gathered = tp_fp8 and lin.name in ("wo", "w2")
        bwd += T * lin.n * (per / s.tp + FP8_TRANSPOSE_BYTES if gathered else per)
        rescale, extra = rescale_work(T, lin.k, lin.n, recipe)
        bwd, kernels = bwd + rescale, kernels + extra
    return fwd, bwd, (0, kernels)


def float8_memory(cfg, s: Shapes, stack: Stack = THIS_TRAINER) -> dict:
    """What Float8's linears add to one block's memory per microbatch (core/dryrun/activations.py
    `layer_memory`'s `extra`): saved bytes by part, and the working set of a cast.

    Eager (torchao float8_linear.py): each linear saves its fp8 cast of the unsharded weight for
    grad input (`ctx.save_for_backward(input_hp, weight_hp_t)`; torchao's own config comment:
    "the entire fp8_weight, instead of the sharded weight may be saved"), kept to backward where
    nothing recomputes the block (a weight the float8 all-gather brought is FSDP's own, freed by
    its reshard); a cast holds its fp32 upcast and the scaled copy at once (`x.to(float32) *
    scale`). With `stack.sac_saves_abs` (torchtitan before PR 820), op SAC keeps abs() of every
    cast's input, eager, or of the weights, compiled rowwise."""
    recipe = recipe_of(cfg)
    if recipe == "bf16":
        return {"saved": {}, "work": 0.0}
    ac, compiled = cfg.activation_checkpoint, cfg.compile.enabled
    lins = [lin for lin in block_linears(s) if converted(lin)]
    weights = sum(lin.k * lin.n for lin in lins)
    saved = {}
    if not compiled and not fp8_all_gather(cfg):
        kept = {"none": 1.0}.get(ac.mode, 0.0)
        if ac.mode == "selective" and ac.selective_ac_option != "op":
            kept = 1 - 1 / int(ac.selective_ac_option)  # the blocks not checkpointed
        if kept:
            saved["float8_weights"] = kept * weights
    if stack.sac_saves_abs and ac.mode == "selective" and ac.selective_ac_option == "op":
        if not compiled:
            saved["float8_abs"] = 2.0 * (weights + sum(s.tokens * lin.k for lin in lins))
        elif recipe == "rowwise":
            saved["float8_abs"] = 2.0 * weights
    work = 0.0 if compiled else 8.0 * s.tokens * max(max(lin.k, lin.n) for lin in lins)
    return {"saved": saved, "work": work}


def fp8_all_gather(cfg) -> bool:
    """FSDP gathers the block linears' weights in float8: tensorwise with the option on, and FSDP
    on; the dry run's copy of core/toggles/float8.py `fp8_all_gather_active` (which imports
    torch), tested equal."""
    p, f8 = cfg.parallelism, cfg.float8
    fsdp = p.dp_replicate * max(p.dp_shard, 1) * p.cp > 1
    return f8.enabled and f8.recipe == "tensorwise" and f8.enable_fsdp_float8_all_gather and fsdp


def block_linear_seconds(spec: GPUSpec, s: Shapes, cfg) -> dict:
    """One block, one microbatch: GEMM seconds forward / backward, cast seconds forward /
    backward, and each linear's (forward, backward) GEMM seconds."""
    recipe = recipe_of(cfg, spec)
    per = {lin.name: gemms(spec, s.tokens, lin, recipe) for lin in block_linears(s)}
    tp_fp8 = s.tp > 1 and recipe == "tensorwise"
    shard = max(1, cfg.parallelism.dp_shard * cfg.parallelism.cp)
    fp8_weights = fp8_all_gather(cfg)
    fb, bb, (kf, kb) = cast_bytes(s, recipe, cfg.compile.enabled, tp_fp8, fp8_weights, shard)
    hbm = spec.hbm_bandwidth * spec.hbm
    return {
        "recipe": recipe,
        "fwd_mm": sum(f for f, _ in per.values()),
        "bwd_mm": sum(b for _, b in per.values()),
        "fwd_cast": fb / hbm + kf * spec.kernel_overhead_s,
        "bwd_cast": bb / hbm + kb * spec.kernel_overhead_s,
        "per_linear": per,
    }
