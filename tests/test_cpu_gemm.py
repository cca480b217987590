"""core.cpu_gemm: bf16 matmuls through the fp32 GEMM on CPUs without a fast bf16 GEMM."""

import time

import pytest
import torch
import torch.nn.functional as F

from core import cpu_gemm
from core.metrics import measure_cpu_peak_flops

pytestmark = pytest.mark.core

BF16 = torch.bfloat16


@pytest.fixture(autouse=True)
def _native_after():
    yield
    cpu_gemm.use("native")
    cpu_gemm.use_scaled_mm("native")


def _pair(*shape_a_b, dtype=BF16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g).to(dtype) for s in shape_a_b]


def test_bf16_mm_and_bmm_are_the_rounded_fp32_product():
    """The route: fp32 products of bf16 values (exact), fp32 sums, one rounding to bf16. It differs
    from torch's bf16 kernel only by the order of the sums: at most one bf16 step apart, rarely."""
    a, b = _pair((96, 300), (300, 40))
    c, d = _pair((3, 64, 200), (3, 200, 24), seed=1)
    native = a @ b, c @ d, torch.mm(a, b, out=torch.empty(0, dtype=BF16))
    cpu_gemm.use("fp32")
    assert cpu_gemm.active() == "fp32"
    routed = a @ b, c @ d, torch.mm(a, b, out=torch.empty(0, dtype=BF16))
    exact = (a.float() @ b.float()).to(BF16), (c.float() @ d.float()).to(BF16)
    assert torch.equal(routed[0], exact[0]) and torch.equal(routed[1], exact[1]) and torch.equal(routed[2], exact[0])
    assert routed[0].dtype == routed[1].dtype == BF16 and routed[2].shape == (96, 40)  # out= resized
    for n, r in zip(native, routed, strict=True):
        assert torch.allclose(n.float(), r.float(), rtol=2**-7, atol=1e-2)  # one bf16 step
        assert (n == r).float().mean() > 0.99


def _cpu_kernel(op: str) -> str:
    """The CPU kernel the dispatcher runs for aten::op (where it was registered)."""
    return next(ln for ln in torch._C._dispatch_dump(f"aten::{op}").splitlines() if ln.startswith("CPU:"))


def test_other_dtypes_and_native_are_torchs_own_kernels():
    """fp32 matmuls under the override are bit-identical to torch's; "native" removes the override
    (torch's kernel is the dispatcher's again)."""
    a, b = _pair((128, 512), (512, 96), dtype=torch.float32)
    c, d = _pair((2, 32, 64), (2, 64, 16), dtype=torch.float32)
    x, y = _pair((256, 1024), (1024, 64), seed=3)
    fp32 = a @ b, c @ d
    native_bf16 = x @ y
    cpu_gemm.use("fp32")
    assert all("core/cpu_gemm.py" in _cpu_kernel(op) for op in ("mm", "bmm"))
    assert torch.equal(a @ b, fp32[0]) and torch.equal(c @ d, fp32[1])
    cpu_gemm.use("native")
    assert not any("core/cpu_gemm.py" in _cpu_kernel(op) for op in ("mm", "bmm"))
    assert cpu_gemm.active() == "native" and torch.equal(x @ y, native_bf16)
    with cpu_gemm.using("fp32"):
        assert cpu_gemm.active() == "fp32"
    assert cpu_gemm.active() == "native"


def test_autograd_of_a_bf16_linear_goes_through_the_route():
    """A linear layer's forward and both backward matmuls (3-D input folded to mm)."""
    x, w = _pair((4, 16, 64), (32, 64))
    grads = {}
    for mode in ("native", "fp32"):
        cpu_gemm.use(mode)
        xi, wi = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = F.linear(xi, wi)
        (y.float() * torch.linspace(-1, 1, 32)).sum().backward()
        grads[mode] = (y, xi.grad, wi.grad)
    for n, r in zip(grads["native"], grads["fp32"], strict=True):
        assert r.dtype == BF16 and torch.allclose(n.float(), r.float(), rtol=2**-7, atol=1e-2)


def test_auto_resolves_to_fp32_only_for_bf16_training_on_a_slow_cpu():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    slow = not cpu_gemm.has_fast_bf16_gemm()
    assert cpu_gemm.resolve("auto", cpu, "bfloat16") == ("fp32" if slow else "native")
    assert cpu_gemm.resolve("auto", cpu, "float32") == "native"
    assert cpu_gemm.resolve("auto", cuda, "bfloat16") == "native"
    assert cpu_gemm.resolve("native", cpu, "bfloat16") == "native"
    assert cpu_gemm.resolve("fp32", cuda, "float32") == "fp32"


def test_peak_measurement_is_bounded_on_a_slow_kernel():
    """The MFU peak grows its matmul only while one takes under 50 ms: torch's scalar bf16 fallback
    ran the old fixed 2048 matmul for minutes per rank."""
    t = time.perf_counter()
    assert measure_cpu_peak_flops(BF16) > 0
    assert time.perf_counter() - t < 20


F8 = torch.float8_e4m3fn


def _scaled_cases():
    """(name, args, kwargs) of _scaled_mm as torchao calls it, and the other forms torch accepts."""
    g = torch.Generator().manual_seed(4)
    a = (3 * torch.randn(96, 64, generator=g)).to(F8)
    b = torch.randn(80, 64, generator=g).to(F8).t()  # column-major, as torchao passes it
    sa, sb = torch.tensor(0.37), torch.tensor(1.9)
    bias = torch.randn(80, generator=g).to(BF16)
    yield "tensorwise", (a, b, sa, sb), {"out_dtype": BF16, "use_fast_accum": True}
    yield "tensorwise fp32 out", (a, b, sa, sb), {"out_dtype": torch.float32}
    yield "bias", (a, b, sa, sb), {"bias": bias, "out_dtype": BF16}
    yield "float8 out", (a, b, sa, sb), {"scale_result": torch.tensor(3.3), "out_dtype": F8}
    yield (
        "rowwise",
        (a, b, torch.rand(96, 1, generator=g) + 0.5, torch.rand(1, 80, generator=g) + 0.5),
        {"out_dtype": BF16},
    )


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == F8 else t


def test_scaled_mm_route_is_torchs_own_cpu_emulation_bit_for_bit():
    """The route computes what torch's CPU kernel computes where it does not hand the matmul to
    oneDNN (torch.backends.mkldnn off selects that kernel on every CPU): equal bits, in the
    functional and the out= form, and "native" gives torch's kernel back."""
    for name, args, kwargs in _scaled_cases():
        out = torch.empty(0, dtype=kwargs["out_dtype"])
        with torch.backends.mkldnn.flags(enabled=False):
            expected = torch._scaled_mm(*args, **kwargs)
        cpu_gemm.use_scaled_mm("fp32")
        assert cpu_gemm.scaled_mm_active() == "fp32"
        assert all("core/cpu_gemm.py" in _cpu_kernel(op) for op in ("_scaled_mm", "_scaled_mm.out"))
        routed, routed_out = torch._scaled_mm(*args, **kwargs), torch._scaled_mm(*args, **kwargs, out=out)
        assert routed.dtype == expected.dtype and routed_out is out, name
        assert torch.equal(_bits(routed), _bits(expected)) and torch.equal(_bits(out), _bits(expected)), name
        cpu_gemm.use_scaled_mm("native")
        assert not any("core/cpu_gemm.py" in _cpu_kernel(op) for op in ("_scaled_mm", "_scaled_mm.out"))


def test_scaled_mm_route_costs_about_an_fp32_matmul():
    """The reason for the route: torch 2.13 sends a CPU float8 matmul to oneDNN's reference kernel
    on AMX CPUs (seconds for this shape). Routed, it costs an fp32 matmul of the same shape plus
    the upcasts, on any CPU."""
    g = torch.Generator().manual_seed(5)
    a, b = torch.randn(512, 256, generator=g), torch.randn(256, 256, generator=g)
    a8, b8, one = a.to(F8), b.t().contiguous().to(F8).t(), torch.tensor(1.0)

    def best_of(fn, n=5):
        times = []
        for _ in range(n):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        return min(times)

    fp32 = best_of(lambda: a @ b)
    cpu_gemm.use_scaled_mm("fp32")
    routed = best_of(lambda: torch._scaled_mm(a8, b8, one, one, out_dtype=BF16))
    assert routed < 20 * fp32 + 2e-3, (routed, fp32)


def test_real_float8_routes_cpu_float8_matmuls_and_emulation_leaves_them():
    """apply_float8 installs the route unless torchao's own emulation (no _scaled_mm) is asked for."""
    from core.config import load_config
    from core.parallel.parallelize import Toggles
    from core.toggles.float8 import apply_float8

    lin = torch.nn.Sequential(torch.nn.Linear(64, 32, bias=False))
    apply_float8(lin, load_config(None, ["float8.enabled=true", "float8.emulate=true"]), Toggles())
    assert cpu_gemm.scaled_mm_active() == "native"
    apply_float8(lin, load_config(None, ["float8.enabled=true"]), Toggles())
    assert cpu_gemm.scaled_mm_active() == "fp32"
