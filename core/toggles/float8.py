"""Float8 training through torchao: swap the block linears for `Float8Linear`.

Recipes (torchao's names): tensorwise (one scale per tensor; the one FSDP2 can all-gather in
float8), rowwise (one scale per row, power-of-2 scales), rowwise_with_gw_hp (rowwise, the weight
gradient kept in high precision). The output projection (`float8.filter_fqns`, default
["output"]) and any linear with a dimension not divisible by 16 (float8 matmul kernels need
16-multiples; with TP the local shard must be one too) stay in high precision.

With FSDP and the tensorwise recipe, `float8.enable_fsdp_float8_all_gather` makes FSDP2 gather
the weights already cast to float8 (half the bytes of bf16); then
`float8.precompute_float8_dynamic_scale_for_fsdp` computes every weight's scale in one fused
all-reduce after each optimizer step (the trainer calls `post_optimizer_hook`), instead of one
small all-reduce per linear in the forward.

Ordering: float8 conversion runs before TP, because torchao's float8-aware TP styles (which
all-gather the sequence-parallel activations in float8) only accept Float8Linear modules.

Hardware: float8 matmuls need CUDA compute capability >= 8.9 (Ada, Hopper); `check_toggle_hardware`
refuses older GPUs before building. On CPU `torch._scaled_mm` runs float8_e4m3fn through torch's
own emulation (core/cpu_gemm.py routes it so on every CPU: torch 2.13 would send it to oneDNN's
reference kernel on AMX CPUs, 800-3000x slower). Proxy rows set `float8.emulate` (torchao's
emulation: the same float8 quantization of inputs and weights, the matmul in fp32, no
`_scaled_mm`); records name it `float8:emulated`. The parity suite and the loss-convergence rows
keep the real `_scaled_mm` on their tiny dims.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
import torch.nn as nn

from core import cpu_gemm
from core.config import ConfigError, JobConfig
from core.noise import quiet_library_warnings

# torchao is imported only when Float8 is on (inside the functions below): importing it costs
# seconds and logs messages (core/noise.py) that a run without Float8 has no reason to show.

MIN_CUDA_CAPABILITY = (8, 9)
RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")


def _fsdp_enabled(cfg: JobConfig) -> bool:
    p = cfg.parallelism
    return p.dp_replicate * max(p.dp_shard, 1) * p.cp > 1


def fp8_all_gather_active(cfg: JobConfig) -> bool:
    f = cfg.float8
    return f.enabled and f.recipe == "tensorwise" and f.enable_fsdp_float8_all_gather and _fsdp_enabled(cfg)


def float8_config(cfg: JobConfig):
    from torchao.float8 import Float8LinearConfig

    f = cfg.float8
    if f.recipe == "tensorwise":
        return Float8LinearConfig(enable_fsdp_float8_all_gather=fp8_all_gather_active(cfg), emulate=f.emulate)
    base = Float8LinearConfig.from_recipe_name(f.recipe)
    if f.emulate:  # the config is frozen: rebuild it with emulate on
        base = dataclasses.replace(base, emulate=True)
    return base


def wants_precision_casts(cfg: JobConfig) -> bool:
    """Rowwise Float8 under compile needs inductor's `emulate_precision_casts` (fused bf16 values
    rounded as eager rounds them): without it compile with recompute gives NaNs
    (pytorch/pytorch#150859). torchtitan turns it on for the rowwise recipe; so do we
    (core/toggles/compile.py, recorded as compile:emulate_precision_casts)."""
    return cfg.float8.enabled and cfg.float8.recipe == "rowwise" and cfg.compile.enabled


def module_filter(cfg: JobConfig) -> Callable[[nn.Module, str], bool]:
    """Convert an nn.Linear unless its FQN matches filter_fqns or a dim (or its TP shard) is not
    a multiple of 16."""
    skip = list(cfg.float8.filter_fqns)
    tp = cfg.parallelism.tp

    def keep(mod: nn.Module, fqn: str) -> bool:
        if not isinstance(mod, nn.Linear) or any(s and s in fqn for s in skip):
            return False
        out_f, in_f = mod.weight.shape
        return all(d % 16 == 0 and (d // tp) % 16 == 0 and d % tp == 0 for d in (out_f, in_f))

    return keep


def _cast_input_for_cpu_autocast(module: nn.Module, args: tuple):
    """Forward pre-hook on Float8Linear: under CPU autocast, cast the input to the autocast dtype.

    Why: Float8Linear.forward mirrors F.linear's autocast cast for CUDA only
    (`torch.is_autocast_enabled()` is the CUDA query). Under CPU autocast its input stays fp32
    while its output becomes bf16, so rowwise_with_gw_hp's high-precision weight-gradient matmul
    (bf16 grad_output x fp32 input) fails with a dtype mismatch in eager mode. Casting here does
    on CPU what torchao does on CUDA (all recipes, identical to the CUDA semantics).
    """
    if torch.is_autocast_enabled("cpu") and args and args[0].dtype != torch.get_autocast_dtype("cpu"):
        return (args[0].to(torch.get_autocast_dtype("cpu")),) + tuple(args[1:])
    return None


def apply_float8(model: nn.Module, cfg: JobConfig, toggles) -> nn.Module:
    """Swap model's eligible nn.Linear modules for torchao Float8Linear, in place."""
    quiet_library_warnings()  # before torchao's first import in a build: it logs known noise then
    from torchao.float8 import convert_to_float8_training
    from torchao.float8.float8_linear import Float8Linear

    f = cfg.float8
    if f.recipe not in RECIPES:
        raise ConfigError(f"float8.recipe: {f.recipe!r} is not one of: {', '.join(RECIPES)}")
    convert_to_float8_training(model, config=float8_config(cfg), module_filter_fn=module_filter(cfg))
    if not f.emulate:  # CPU float8 matmuls as torch emulates them on every CPU (core/cpu_gemm.py)
        cpu_gemm.use_scaled_mm("fp32")
    converted = [m for m in model.modules() if isinstance(m, Float8Linear)]
    if not converted:
        toggles.skip("float8", "no linear passed the filter (filter_fqns, dims divisible by 16)")
        return model
    for m in converted:
        m.register_forward_pre_hook(_cast_input_for_cpu_autocast)
    toggles.apply("float8")
    toggles.apply(f"float8:{f.recipe}")
    if f.emulate:
        toggles.apply("float8:emulated")
    if f.enable_fsdp_float8_all_gather:
        if fp8_all_gather_active(cfg):
            toggles.apply("float8_fsdp_all_gather")
        else:
            toggles.skip("float8_fsdp_all_gather", "no FSDP in this layout (dp_shard * dp_replicate * cp = 1)")
    return model


def post_optimizer_hook(cfg: JobConfig) -> Callable[[list[nn.Module]], None] | None:
    """What the trainer calls after optimizer.step(): precompute the float8 scales of every
    FSDP-sharded weight (one all-reduce for all of them). None when not configured."""
    if not (cfg.float8.precompute_float8_dynamic_scale_for_fsdp and fp8_all_gather_active(cfg)):
        return None
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    def hook(model_parts: list[nn.Module]) -> None:
        for part in model_parts:
            precompute_float8_dynamic_scale_for_fsdp(part)

    return hook


# AMD GPUs with FP8 matrix cores, by LLVM target: gfx942 (MI300X, MI325X; torchao casts to
# e4m3fnuz there) and gfx950 (MI350X, MI355X; OCP e4m3fn). ROCm reports a GFX version, not a CUDA
# sm, as the device capability ((9, 0) is the MI250X, which has none).
ROCM_FP8_ARCHS = ("gfx942", "gfx950")


def device_fp8_problem(index: int = 0) -> str | None:
    """Why GPU `index` has no float8 matmuls, or None (CUDA sm89+, or an FP8-capable ROCm part)."""
    name = torch.cuda.get_device_name(index)
    if torch.version.hip:
        arch = getattr(torch.cuda.get_device_properties(index), "gcnArchName", "")
        if arch.split(":")[0] in ROCM_FP8_ARCHS:
            return None
        return f"float8 matmuls need an AMD GPU of {' or '.join(ROCM_FP8_ARCHS)} (MI300 series on); {name} is {arch}"
    cap = torch.cuda.get_device_capability(index)
    if tuple(cap) < MIN_CUDA_CAPABILITY:
        need = "CUDA compute capability >= sm89 (Ada/Hopper, e.g. H100)"
        return f"float8 matmuls need {need}; {name} is sm{cap[0]}{cap[1]}"
    return None


def hardware_problem(cfg: JobConfig) -> str | None:
    """Why this machine cannot run cfg's float8, or None. CPU proxies run it (numerics only)."""
    if not cfg.float8.enabled or cfg.float8.emulate:
        return None
    if torch.cuda.is_available():
        problem = device_fp8_problem()
        return f"float8.enabled: {problem} (or set float8.emulate=true)" if problem else None
    if cfg.job.mode == "real":
        return (
            "float8.enabled: real mode needs CUDA GPUs with compute capability >= sm89 "
            "(Ada/Hopper, e.g. H100); no CUDA device here"
        )
    return None
