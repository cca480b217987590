"""bf16 matmuls on CPUs where torch has no fast bf16 GEMM.

torch 2.13 runs a CPU bf16 GEMM in oneDNN only when the CPU has AVX-512
(`torch.ops.mkldnn._is_mkldnn_bf16_supported()`); elsewhere (an AVX2-only x86, say) it falls
back to a scalar loop 10-70x slower than its fp32 GEMM (0.25-1.45 GFLOP/s against 11-34, by shape, on one AMD EPYC
core). `training.bf16_gemm = "fp32"` routes bf16 `mm` and `bmm` (and their out= forms, which
compiled graphs call) through the fp32 GEMM instead: a product of two bf16 numbers is exact in
fp32, both kernels accumulate in fp32 and round the result to bf16 once, so only the order of
the summation differs. Written here because torch has no switch for it: the override is a CPU
kernel registered for the two aten ops, in this process only, and removed again by "native".

Float8 matmuls (`_scaled_mm`, what torchao's Float8 linears call) have a trouble of their own:
on a CPU with AMX-int8 torch 2.13 sends them to oneDNN, whose float8 matmul there is its
reference kernel (`ref:any`; 92 ms for 128x64x96, 53 s for 2048x256x768 on one AMX Xeon core),
800-3000x slower than torch's own CPU emulation that every other x86 CPU runs (upcast to fp32,
scale, fp32 GEMM, round once: aten/src/ATen/native/Blas.cpp `_scaled_mm_out_cpu_emulated`).
`use_scaled_mm("fp32")` registers that emulation as the CPU kernel of `_scaled_mm` and
`_scaled_mm.out` (compiled graphs call the latter), so Float8 on a CPU costs and computes the
same on every machine class. CUDA tensors never reach a CPU kernel.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Literal

import torch

Bf16Gemm = Literal["auto", "native", "fp32"]

_library: torch.library.Library | None = None  # the registered override; None: torch's kernels
_scaled_library: torch.library.Library | None = None  # likewise for _scaled_mm


def has_fast_bf16_gemm() -> bool:
    """torch's own test for sending a CPU bf16 GEMM to oneDNN (AVX-512 or AMX on x86, bf16 on Arm)."""
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())  # private op: torch's own test, no public one


def resolve(choice: Bf16Gemm, device: torch.device, param_dtype: str) -> Literal["native", "fp32"]:
    """auto: fp32 for bf16 training on a CPU without oneDNN's bf16 GEMM, else native."""
    if choice != "auto":
        return choice
    slow_cpu = device.type == "cpu" and not has_fast_bf16_gemm()
    return "fp32" if slow_cpu and param_dtype == "bfloat16" else "native"


def active() -> Literal["native", "fp32"]:
    return "native" if _library is None else "fp32"


def use(mode: Literal["native", "fp32"]) -> None:
    """Install (fp32) or remove (native) the override in this process; idempotent."""
    global _library
    if mode == active():
        return
    if mode == "native":
        _library._destroy()  # private: a Library cannot be removed publicly; torch's kernels come back
        _library = None
        return
    _library = _cpu_kernels({"mm": _mm, "mm.out": _mm_out, "bmm": _bmm, "bmm.out": _bmm_out})


def _cpu_kernels(kernels: dict) -> torch.library.Library:
    """Register each aten op's CPU kernel in a Library of this process (destroying it restores torch's)."""
    lib = torch.library.Library("aten", "IMPL")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "Overriding a previously registered kernel": the point
        for name, kernel in kernels.items():
            lib.impl(name, kernel, "CPU")
    return lib


@contextmanager
def using(mode: Literal["native", "fp32"]) -> Iterator[None]:
    """`use(mode)` for a block of this process, the previous mode restored after it."""
    before = active()
    use(mode)
    try:
        yield
    finally:
        use(before)


# Other dtypes go to torch's addmm / baddbmm with beta=0: the same CPU GEMM as mm / bmm (torch's
# mm kernel is addmm's with beta 0), which this override leaves alone.
def _mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    if a.dtype == b.dtype == torch.bfloat16:
        return _mm(a.float(), b.float()).to(torch.bfloat16)
    return torch.addmm(a.new_zeros(()).expand(a.shape[0], b.shape[1]), a, b, beta=0)


def _bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    if a.dtype == b.dtype == torch.bfloat16:
        return _bmm(a.float(), b.float()).to(torch.bfloat16)
    return torch.baddbmm(a.new_zeros(()).expand(a.shape[0], a.shape[1], b.shape[2]), a, b, beta=0)


def _into(out: torch.Tensor, result: torch.Tensor) -> torch.Tensor:
    if out.shape != result.shape:
        out.resize_(result.shape)
    return out.copy_(result)


def _mm_out(a: torch.Tensor, b: torch.Tensor, *, out: torch.Tensor) -> torch.Tensor:
    return _into(out, _mm(a, b))


def _bmm_out(a: torch.Tensor, b: torch.Tensor, *, out: torch.Tensor) -> torch.Tensor:
    return _into(out, _bmm(a, b))


# ------------------------------------------------------------------------------- float8 matmuls
def scaled_mm_active() -> Literal["native", "fp32"]:
    return "native" if _scaled_library is None else "fp32"


def use_scaled_mm(mode: Literal["native", "fp32"]) -> None:
    """Install (fp32: torch's CPU emulation on every CPU) or remove (native) the `_scaled_mm`
    override in this process; idempotent."""
    global _scaled_library
    if mode == scaled_mm_active():
        return
    if mode == "native":
        _scaled_library._destroy()  # private, as above
        _scaled_library = None
        return
    _scaled_library = _cpu_kernels({"_scaled_mm": _scaled_mm, "_scaled_mm.out": _scaled_mm_out})


def _scaled_mm(a, b, scale_a, scale_b, bias=None, scale_result=None, out_dtype=None, use_fast_accum=False):
    """torch's `_scaled_mm_out_cpu_emulated`, op for op: each operand upcast to fp32 and multiplied
    by its scale (one per tensor, or per row of a / column of b), an fp32 matmul, the bias added
    in fp32, a float8 result divided by scale_result, one cast to the output dtype. use_fast_accum
    only selects a CUDA kernel."""
    del use_fast_accum
    if not (a.dtype.is_floating_point and a.element_size() == 1 and b.element_size() == 1):
        raise RuntimeError(f"_scaled_mm: expected float8 matrices, got {a.dtype} and {b.dtype}")
    tensorwise = scale_a.numel() == 1 and scale_b.numel() == 1
    fa = a.contiguous().float() * (scale_a.item() if tensorwise else scale_a)
    fb = b.contiguous().float() * (scale_b.item() if tensorwise else scale_b)
    product = torch.matmul(fa, fb)
    if bias is not None:
        product.add_(bias)
    dtype = out_dtype or a.dtype
    if scale_result is not None and dtype.itemsize == 1:  # float8 output
        product = product * (1 / scale_result.float()).item()  # fp32 1/x, as torch's `1 / float`
    return product.to(dtype)


def _scaled_mm_out(a, b, scale_a, scale_b, bias=None, scale_result=None, out_dtype=None, use_fast_accum=False, *, out):
    return _into(out, _scaled_mm(a, b, scale_a, scale_b, bias, scale_result, out_dtype or out.dtype, use_fast_accum))
