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

Cast traffic per element, from torchao's float8 roofline model (torchao/testing/training/
roofline_utils.py `get_tensor_memory_traffic_ovhd_s`): a tensor's amax pass can fuse into the op
that produced it when the block is compiled (its `fuse_with_prev`); a weight's cannot (FSDP's
all-gather produces it). The three linears reading one input (wq, wk, wv; w1, w3) cast it once:
AOTAutograd's common-subexpression elimination merges the identical casts of a compiled block.
With Float8's TP styles (tensorwise) an input or output gradient is cast on its sequence shard
before the float8 all-gather, then transposed once gathered; with the FSDP float8 all-gather a
weight arrives cast, leaving its transpose.
"""

from __future__ import annotations

from dataclasses import dataclass

from core.dryrun.activations import Shapes, shapes
from core.dryrun.gemm import gemm_seconds
from core.dryrun.gpuspec import GPUSpec
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
RESCALE_BYTES = 4  # the rescaling kernel after a slow-accumulation rowwise GEMM reads and writes bf16
FP8_TRANSPOSE_BYTES = 2  # a gathered fp8 tensor copied to the other layout


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


def linear_gemm_shapes(tokens: float, n: int, k: int) -> tuple[GemmShape, GemmShape, GemmShape]:
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


def recipe_of(cfg) -> str:
    """The precision recipe of the block linears; ValueError for one the model has no costs for."""
    if not cfg.float8.enabled:
        return "bf16"
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
    """(forward, backward) seconds of the linear's GEMMs for `tokens` rows."""
    out, g_in, g_w = gemm_kinds(lin, recipe)
    f, gi, gw = linear_gemm_shapes(tokens, lin.n, lin.k)
    fwd = gemm_seconds(spec, *f, out)
    bwd = gemm_seconds(spec, *gi, g_in) + gemm_seconds(spec, *gw, g_w)
    return fwd, bwd


def cast_bytes(s: Shapes, recipe: str, compiled: bool, tp_fp8: bool, fp8_weights: bool, shard: int) -> tuple:
    """(forward, backward) HBM bytes of Float8's casts for one block and one microbatch, and the
    number of extra kernels (rescales) backward launches."""
    if recipe == "bf16":
        return 0.0, 0.0, 0
    T = s.tokens
    fwd = bwd = 0.0
    kernels = 0
    seen = set()
    fused = 1 if compiled else 0
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
        if recipe == "rowwise":
            bwd += RESCALE_BYTES * (T * lin.k + lin.n * lin.k)
            kernels += 2
        elif recipe == "rowwise_with_gw_hp":
            bwd += RESCALE_BYTES * T * lin.k
            kernels += 1
    return fwd, bwd, kernels


def block_linear_seconds(spec: GPUSpec, s: Shapes, cfg) -> dict:
    """One block, one microbatch: GEMM seconds forward / backward, cast seconds forward /
    backward, and each linear's (forward, backward) GEMM seconds."""
    recipe = recipe_of(cfg)
    per = {lin.name: gemms(spec, s.tokens, lin, recipe) for lin in block_linears(s)}
    tp_fp8 = s.tp > 1 and recipe == "tensorwise"
    f8 = cfg.float8
    fp8_weights = recipe == "tensorwise" and f8.enable_fsdp_float8_all_gather
    shard = max(1, cfg.parallelism.dp_shard * cfg.parallelism.cp)
    fb, bb, kernels = cast_bytes(s, recipe, cfg.compile.enabled, tp_fp8, fp8_weights, shard)
    hbm = spec.hbm_bandwidth * spec.hbm
    return {
        "recipe": recipe,
        "fwd_mm": sum(f for f, _ in per.values()),
        "bwd_mm": sum(b for _, b in per.values()),
        "fwd_cast": fb / hbm,
        "bwd_cast": bb / hbm + kernels * spec.kernel_overhead_s,
        "per_linear": per,
    }
