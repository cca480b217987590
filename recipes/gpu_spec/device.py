"""The device `run-recipe gpu-spec --measure` measures: the CUDA GPU when there is one, else this
CPU, with what names it (device, torch, driver) and which GEMM kernel families it runs.

A CPU stands for one "GPU" of `threads` threads: the trainer's CPU proxies run the same way, and
the step `run-recipe preflight --gpus 1` compares against is one such process. Its bf16 GEMMs
are the trainer's (core/cpu_gemm.py: the fp32 GEMM on a CPU without oneDNN's bf16 one).
"""

from __future__ import annotations

import os
import platform
from dataclasses import dataclass

import torch

from core.dryrun.gpuspec import GEMM_KINDS, known_gpus
from core.metrics import gpu_model


class CannotMeasure(RuntimeError):
    """A benchmark this device cannot run; the message names the benchmark and why (one line)."""


@dataclass(frozen=True)
class Device:
    kind: str  # "cuda" | "cpu"
    name: str  # what the spec's [measured].device says
    torch_version: str
    driver: str  # CUDA: driver and runtime versions; CPU: "no GPU driver (CPU)"
    threads: int  # CPU: torch's intra-op threads; CUDA: 1
    capability: tuple[int, int] | None  # CUDA compute capability
    memory_gib: float  # what torch can use: the GPU's memory, or this CPU's RAM per process

    @property
    def torch_device(self) -> torch.device:
        return torch.device("cuda", torch.cuda.current_device()) if self.kind == "cuda" else torch.device("cpu")

    def sync(self) -> None:
        if self.kind == "cuda":
            torch.cuda.synchronize()


def _cpu_ram_gib() -> float:
    try:
        with open("/proc/meminfo") as f:
            kb = next(int(line.split()[1]) for line in f if line.startswith("MemTotal"))
        return kb / 2**20
    except (OSError, StopIteration):
        return 0.0


def _cuda_driver() -> str:
    runtime = f"CUDA {torch.version.cuda}"
    try:
        import pynvml  # optional: nvidia-ml-py, present with most CUDA installs
    except ImportError:
        return f"{runtime} (driver version not read: no pynvml)"
    try:
        pynvml.nvmlInit()
        version = pynvml.nvmlSystemGetDriverVersion()
    except pynvml.NVMLError as e:
        return f"{runtime} (driver version not read: {e})"
    return f"driver {version.decode() if isinstance(version, bytes) else version}, {runtime}"


def select_device(want: str = "auto", threads: int | None = None) -> Device:
    """The CUDA GPU (`want` "cuda", or "auto" when one is visible) or this CPU ("cpu", or "auto"
    without CUDA); CannotMeasure when CUDA is asked for and there is none. `threads`: a CPU's
    intra-op threads (default: torch's)."""
    if want not in ("auto", "cuda", "cpu"):
        raise ValueError(f"device {want!r}: auto, cuda or cpu")
    if want == "cuda" and not torch.cuda.is_available():
        build = "a CPU-only build" if torch.version.cuda is None else f"CUDA {torch.version.cuda}, no GPU visible"
        raise CannotMeasure(f"device: no CUDA GPU to measure (torch {torch.__version__} here is {build})")
    if want != "cpu" and torch.cuda.is_available():
        idx = torch.cuda.current_device()
        props = torch.cuda.get_device_properties(idx)
        return Device(
            "cuda",
            props.name,
            torch.__version__,
            _cuda_driver(),
            1,
            (props.major, props.minor),
            props.total_memory / 2**30,
        )
    from core.metrics import cpu_model  # the project's CPU name with its matmul ISA

    if threads:
        torch.set_num_threads(threads)
    n = torch.get_num_threads()
    return Device(
        "cpu",
        f"cpu ({cpu_model()}, {os.cpu_count()} cores, {n} thread{'s' * (n > 1)}; {platform.machine()})",
        torch.__version__,
        "no GPU driver (CPU)",
        n,
        None,
        _cpu_ram_gib() / max(1, (os.cpu_count() or 1) // n),
    )


def gemm_support(dev: Device) -> dict[str, str | None]:
    """{GEMM kind: None when the device runs it, else why not}. Float8 needs a CUDA GPU of
    compute capability sm89+ (core/toggles/float8.py); on one, a probe of each `_scaled_mm`
    form decides (torch builds differ in the rowwise kernels they ship)."""
    from core.toggles.float8 import MIN_CUDA_CAPABILITY

    out: dict[str, str | None] = {"bf16": None}
    for kind in GEMM_KINDS[1:]:
        if dev.kind == "cpu":
            out[kind] = (
                "no float8 matmul on a CPU (torch._scaled_mm needs a CUDA GPU of compute capability "
                f"sm{''.join(map(str, MIN_CUDA_CAPABILITY))}+; the trainer emulates Float8 here)"
            )
        elif dev.capability is None or dev.capability < MIN_CUDA_CAPABILITY:
            out[kind] = f"{dev.name} is sm{''.join(map(str, dev.capability or (0, 0)))}: float8 matmuls need sm89+"
        else:
            out[kind] = _probe_scaled_mm(dev, kind)
    return out


def scaled_mm_inputs(dev: Device, m: int, n: int, k: int, kind: str):
    """(A, B, scale A, scale B) of a `_scaled_mm` of the kind: float8 e4m3 A (m x k) row-major and
    B (k x n) column-major, as cuBLAS and the CUTLASS rowwise kernel take them."""
    d = dev.torch_device
    a = torch.randn(m, k, device=d).to(torch.float8_e4m3fn)
    b = torch.randn(n, k, device=d).to(torch.float8_e4m3fn).t()
    if kind == "fp8_rowwise":
        return a, b, torch.ones(m, 1, device=d), torch.ones(1, n, device=d)
    return a, b, torch.ones((), device=d), torch.ones((), device=d)


def _probe_scaled_mm(dev: Device, kind: str) -> str | None:
    try:
        a, b, sa, sb = scaled_mm_inputs(dev, 64, 64, 64, kind)
        torch._scaled_mm(a, b, sa, sb, out_dtype=torch.bfloat16, use_fast_accum=True)
        dev.sync()
    except (RuntimeError, NotImplementedError) as e:
        return f"torch {torch.__version__} on {dev.name}: {str(e).splitlines()[0]}"
    return None


def base_spec(dev: Device) -> str | None:
    """The shipped spec of this GPU model (its datasheet peaks and the numbers no one node can
    measure: the network), matched by the name CUDA reports; None for a CPU or another GPU."""
    if dev.kind != "cuda":
        return None
    model = gpu_model(dev.name)  # core/metrics.py: the whole name, not a part of it ("GB200" is no B200)
    if model == "H100 SXM":
        match = "h100_96gb_hbm2e_500w" if dev.memory_gib > 85 else "h100_sxm_80gb"
    else:
        match = {"H200 SXM": "h200_141gb", "B200 SXM": "b200"}.get(model or "", "")
    return match if match in known_gpus() else None
