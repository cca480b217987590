"""bf16 matmuls on CPUs where torch has no fast bf16 GEMM.

torch 2.13 runs a CPU bf16 GEMM in oneDNN only when the CPU has AVX-512
(`torch.ops.mkldnn._is_mkldnn_bf16_supported()`); elsewhere (an AVX2-only x86, say) it falls
back to a scalar loop 10-70x slower than its fp32 GEMM (0.25-1.45 GFLOP/s against 11-34, by shape, on one AMD EPYC
core). `training.bf16_gemm = "fp32"` routes bf16 `mm` and `bmm` (and their out= forms, which
compiled graphs call) through the fp32 GEMM instead: a product of two bf16 numbers is exact in
fp32, both kernels accumulate in fp32 and round the result to bf16 once, so only the order of
the summation differs. Written here because torch has no switch for it: the override is a CPU
kernel registered for the two aten ops, in this process only, and removed again by "native".
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Literal

import torch

Bf16Gemm = Literal["auto", "native", "fp32"]

_library: torch.library.Library | None = None  # the registered override; None: torch's kernels


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
    lib = torch.library.Library("aten", "IMPL")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "Overriding a previously registered kernel": the point
        for name, kernel in (("mm", _mm), ("mm.out", _mm_out), ("bmm", _bmm), ("bmm.out", _bmm_out)):
            lib.impl(name, kernel, "CPU")
    _library = lib


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
