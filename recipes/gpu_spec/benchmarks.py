"""The microbenchmarks of one device, as probes: a call to time and the work one call does (FLOPs
or bytes). `run_probes` times them interleaved, pass after pass over every probe, and keeps each
probe's trimmed mean (`typical`): on a shared machine a burst of load then falls on every probe
alike instead of on whichever one ran during it; the preemptions count as they count in a training
step, which lasts through them (a median of millisecond samples would leave them out), and a rare
long stall does not (as the median over a run's steps leaves one out).

- GEMMs at the model's shapes (core/dryrun/linears.py `model_gemms`) in each kernel family: bf16
  `torch.mm` (on a CPU through the trainer's bf16 route, core/cpu_gemm.py, installed by the
  caller), and on a GPU with float8 the `_scaled_mm` forms torchao calls (tensorwise: one scale
  per tensor; rowwise: one per row of A and column of B; fast accumulation);
- SDPA forward, and forward + backward, as the model calls it (core/models/llama3.py
  `ScaledDotProductAttention`: causal; fp32 on a CPU, as the trainer resolves it);
- streaming: a copy of a large bf16 tensor (the bandwidth peak), and the eager pointwise kernels
  of a block at its activations' size, each writing a new tensor as eager code does: a bf16
  multiply (SwiGLU), the cast to fp32, an fp32 multiply and the cast back (RMSNorm);
- one kernel's fixed cost: a tiny bf16 GEMM.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from recipes.gpu_spec.device import CannotMeasure, Device, scaled_mm_inputs

# A CUDA sample repeats a call until it takes this long: launches are microseconds but a sample's
# closing synchronize costs ~0.1 ms on a virtualised H200 (measured), 1% of 10 ms.
CUDA_SAMPLE_S = 10e-3
MAX_INNER = 1 << 16


@dataclass
class Probe:
    label: str
    call: Callable[[], object]
    work: float  # FLOPs or bytes of one call
    shape: tuple[int, ...] = ()  # the size probed: (m, n, k) of a GEMM, (seq,) of attention
    inner: int = 1  # calls per sample (set by the warm-up)
    seconds: float = 0.0  # one call's typical time (set by run_probes)

    @property
    def rate(self) -> float:
        return self.work / self.seconds


def typical(samples: list[float]) -> float:
    """The mean of the samples without their highest and lowest fifth."""
    cut = len(samples) // 5
    return statistics.fmean(sorted(samples)[cut : len(samples) - cut])


def _sample(dev: Device, p: Probe) -> float:
    t = time.perf_counter()
    try:
        for _ in range(p.inner):
            p.call()
        dev.sync()
    except (RuntimeError, NotImplementedError, TypeError, ValueError) as e:  # the device cannot run it
        raise CannotMeasure(f"{p.label}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from e
    return (time.perf_counter() - t) / p.inner


def run_probes(dev: Device, probes: list[Probe], passes: int, progress: Callable[[str], None]) -> None:
    """A warm-up call of each probe (on CUDA it also sizes the probe's batch of calls), then
    `passes` passes over all of them; each probe's `seconds` is the `typical` of its samples."""
    for p in probes:
        _sample(dev, p)  # the first call pays lazy set-up (library handles, kernel loading)
        if dev.kind == "cuda":
            _size_batch(dev, p)
    samples: list[list[float]] = [[] for _ in probes]
    for i in range(passes):
        t = time.perf_counter()
        for p, s in zip(probes, samples, strict=True):
            s.append(_sample(dev, p))
        progress(f"  pass {i + 1}/{passes} over {len(probes)} benchmarks: {time.perf_counter() - t:.1f} s")
    for p, s in zip(probes, samples, strict=True):
        p.seconds = typical(s)


def _size_batch(dev: Device, p: Probe) -> None:
    """Grow a probe's calls per sample until one sample lasts CUDA_SAMPLE_S: sized from a single
    call, a small kernel's sample would be mostly the synchronize (133 us per "launch" measured so
    on an H200, where a launch in a stream of them costs a few)."""
    while p.inner < MAX_INNER:
        total = _sample(dev, p) * p.inner
        if total >= CUDA_SAMPLE_S:
            return
        p.inner = min(MAX_INNER, max(2 * p.inner, math.ceil(p.inner * CUDA_SAMPLE_S / max(total, 1e-9))))


# --------------------------------------------------------------------------------------- GEMMs
def gemm_probe(dev: Device, m: int, n: int, k: int, kind: str) -> Probe:
    """One (m x k) @ (k x n) GEMM of the kernel family, bf16 result; work in FLOPs."""
    if kind == "bf16":
        a = torch.randn(m, k, device=dev.torch_device, dtype=torch.bfloat16)
        b = torch.randn(k, n, device=dev.torch_device, dtype=torch.bfloat16)
        call: Callable[[], object] = lambda: torch.mm(a, b)  # noqa: E731
    else:
        a, b, sa, sb = scaled_mm_inputs(dev, m, n, k, kind)
        call = lambda: torch._scaled_mm(a, b, sa, sb, out_dtype=torch.bfloat16, use_fast_accum=True)  # noqa: E731
    return Probe(f"gemm {kind} {m}x{n}x{k}", call, 2.0 * m * n * k, (m, n, k))


def overhead_probe(dev: Device) -> Probe:
    """A 16 x 16 x 16 bf16 GEMM: a kernel's fixed cost (launch on a GPU; dispatch and, on a CPU,
    the bf16 route's casts); its `seconds` is the figure."""
    a = torch.randn(16, 16, device=dev.torch_device, dtype=torch.bfloat16)
    return Probe("kernel overhead (16x16x16 GEMM)", lambda: torch.mm(a, a), 1.0)


# ----------------------------------------------------------------------------------- attention
def causal_attention_flops(batch: int, heads: int, seq: int, head_dim: int) -> float:
    """Forward FLOPs of causal attention as the model counts them (core/dryrun/runtime.py
    `block_flops`: half of the dense 4 x seq^2 x width)."""
    return 4.0 * batch * seq * seq * heads * head_dim / 2


def attention_probes(dev: Device, batch: int, heads: int, seq: int, head_dim: int, fp32: bool) -> tuple[Probe, Probe]:
    """(forward, forward + backward) of the model's SDPA on bf16 q, k, v (batch, heads, seq,
    head_dim); work: the forward's FLOPs for both (the backward's rate is derived from the two)."""
    from core.models.llama3 import ScaledDotProductAttention

    sdpa = ScaledDotProductAttention(fp32)
    shape = (batch, heads, seq, head_dim)
    q, k, v = (torch.randn(shape, device=dev.torch_device, dtype=torch.bfloat16, requires_grad=True) for _ in "qkv")
    grad = torch.randn(shape, device=dev.torch_device, dtype=torch.bfloat16)

    def forward():
        with torch.no_grad():
            return sdpa(q, k, v)

    def forward_backward():
        sdpa(q, k, v).backward(grad)

    flops = causal_attention_flops(batch, heads, seq, head_dim)
    return Probe(f"sdpa forward seq {seq}", forward, flops, (seq,)), Probe(
        f"sdpa forward+backward seq {seq}", forward_backward, flops, (seq,)
    )


def backward_rate(fwd: Probe, both: Probe) -> float:
    """FLOP/s of the backward: 2.5 x the forward's FLOPs (core/dryrun/runtime.py) over the time
    forward + backward takes beyond the forward."""
    from core.dryrun.runtime import FLASH_BWD_OVER_FWD

    return FLASH_BWD_OVER_FWD * fwd.work / max(both.seconds - fwd.seconds, 1e-9)


# ---------------------------------------------------------------------------------- streaming
def copy_probe(dev: Device, nbytes: int) -> Probe:
    """A copy of a bf16 tensor of `nbytes` into another; work: bytes read + written."""
    x = torch.empty(nbytes // 2, device=dev.torch_device, dtype=torch.bfloat16).normal_()
    y = torch.empty_like(x)
    return Probe(f"copy {nbytes >> 20} MiB", lambda: y.copy_(x), 2.0 * x.numel() * 2)


def pointwise_probes(dev: Device, elements: int) -> list[Probe]:
    """The eager pointwise kernels of a block at its activations' size; work: bytes moved (the
    products read two distinct tensors: `x * x` reads one, which measured 1.5x the bytes)."""
    x, y = (torch.randn(elements, device=dev.torch_device, dtype=torch.bfloat16) for _ in "xy")
    xf, yf = x.float(), y.float()
    kernels = (("bf16 x bf16", lambda: x * y, 6), ("bf16 -> fp32", lambda: x.float(), 6))
    kernels += (("fp32 x fp32", lambda: xf * yf, 12), ("fp32 -> bf16", lambda: xf.bfloat16(), 6))
    return [Probe(f"pointwise {name} x {elements:,}", fn, b * elements) for name, fn, b in kernels]
