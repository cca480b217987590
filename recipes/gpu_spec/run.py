"""Every benchmark of one device, with progress lines; the first one the device cannot run stops
the measurement with CannotMeasure naming it (nothing is written: the spec is assembled from a
complete `Measurements` only)."""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable

from recipes.gpu_spec import benchmarks as B
from recipes.gpu_spec import collectives
from recipes.gpu_spec.device import CannotMeasure, Device, gemm_support
from recipes.gpu_spec.shapes import attention_lengths, measured_configs


@dataclasses.dataclass
class Measurements:
    device: Device
    passes: int
    gemm: dict[str, list[tuple[int, int, int, float]]]  # kind -> [(m, n, k, FLOP/s)]
    skipped: dict[str, str]  # GEMM kind -> why the device does not run it
    attention_seq: int  # the sequence length whose rates the spec states
    attention_shape: tuple[int, int, int, bool]  # (batch, heads, head dim, fp32) of the SDPA calls
    pointwise_elements: int
    configs: str  # the models whose shapes were measured
    attention: list[tuple[int, float, float]] = dataclasses.field(default_factory=list)  # (seq, fwd, bwd FLOP/s)
    copy_bps: float = 0.0
    pointwise_bps: float = 0.0
    kernel_overhead_s: float = 0.0
    collectives: dict | None = None
    collectives_skipped: str = ""
    wall_s: float = 0.0


def _sizes(dev: Device, quick: bool) -> tuple[int, int, int]:
    """(copy bytes, collective bytes, passes): large enough to leave the caches (a CPU's L3 is
    tens of MiB), small enough to run in seconds."""
    if dev.kind == "cuda":
        return 1 << 30, 256 << 20, 5 if quick else 10
    return (32 << 20, 1 << 20, 3) if quick else (256 << 20, 16 << 20, 11)


def _new(dev: Device, quick: bool, kinds: tuple[str, ...] | None) -> tuple[Measurements, list]:
    """The measurements to fill, and the configs whose shapes they measure."""
    from core.build import with_attention_dtype
    from core.dryrun.activations import shapes
    from core.models.args import model_args

    support = gemm_support(dev)
    if kinds:  # asked for by name: a kind the device lacks is refused, not skipped
        for kind in kinds:
            if support.get(kind):
                raise CannotMeasure(f"gemm {kind}: {support[kind]}")
    wanted = [k for k in (kinds or support) if support[k] is None]
    cfgs = measured_configs(dev.kind, quick)
    ref = cfgs[0]
    args = with_attention_dtype(model_args(ref, None), ref, dev.torch_device)
    s = shapes(ref)
    m = Measurements(
        dev,
        _sizes(dev, quick)[2],
        {k: [] for k in wanted},
        {k: r for k, r in support.items() if r and k not in wanted},
        ref.training.seq_len,
        (ref.training.local_batch_size, args.n_heads, args.head_dim, args.attention_fp32),
        s.tokens * s.f,
        ", ".join(
            f"{c.model.flavor} TP {c.parallelism.tp} seq {c.training.seq_len} x {c.training.local_batch_size}"
            for c in cfgs
        ),
    )
    return m, cfgs


def _probes(m: Measurements, cfgs: list, quick: bool) -> dict[str, list]:
    """The probes by group: gemm (per kind), sdpa (forward, forward + backward per length),
    pointwise, overhead, copy (the order of each pass). A probe the device cannot set up is refused."""
    from core.dryrun.linears import model_gemms

    dev = m.device
    groups: dict[str, list] = {}

    def add(group: str, label: str, make):
        try:
            made = make()
        except (RuntimeError, NotImplementedError, TypeError, ValueError) as e:
            raise CannotMeasure(f"{label}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from e
        groups.setdefault(group, []).extend(made if isinstance(made, (list, tuple)) else [made])

    gemms = sorted({g for c in cfgs for g in model_gemms(c)}, key=lambda g: g[0] * g[1] * g[2])
    for kind in m.gemm:
        for g in gemms:
            add(f"gemm {kind}", f"gemm {kind} {g[0]}x{g[1]}x{g[2]}", lambda g=g, kind=kind: B.gemm_probe(dev, *g, kind))
    batch, heads, hd, fp32 = m.attention_shape
    for seq in attention_lengths(dev.kind, m.attention_seq, quick):
        add("sdpa", f"sdpa seq {seq}", lambda seq=seq: B.attention_probes(dev, batch, heads, seq, hd, fp32))
    add("pointwise", f"pointwise x {m.pointwise_elements:,}", lambda: B.pointwise_probes(dev, m.pointwise_elements))
    # after the pointwise kernels, as a step's GEMMs follow ops on its activations (after the large
    # copy a CPU's tiny GEMM takes several times longer: its caches are cold)
    add("overhead", "kernel overhead", lambda: B.overhead_probe(dev))
    copy_bytes = _sizes(dev, quick)[0]  # last: it leaves the caches cold for the next pass's first probe only
    add("copy", f"copy {copy_bytes >> 20} MiB", lambda: B.copy_probe(dev, copy_bytes))
    return groups


def _record(m: Measurements, groups: dict[str, list], progress: Callable[[str], None]) -> None:
    """The probes' typical rates into the measurements, one line each."""

    def rate(r: float) -> str:
        return f"{r / 1e12:.3g} TFLOP/s" if r > 1e12 else f"{r / 1e9:.3g} GFLOP/s"

    for kind in m.gemm:
        for p in groups[f"gemm {kind}"]:
            m.gemm[kind].append((*p.shape, p.rate))
            progress(f"{p.label}: {rate(p.rate)}")
    sdpa = groups["sdpa"]
    for fwd, both in zip(sdpa[::2], sdpa[1::2], strict=True):
        seq = fwd.shape[0]
        m.attention.append((seq, fwd.rate, B.backward_rate(fwd, both)))
        progress(f"sdpa seq {seq}: forward {rate(fwd.rate)}, backward {rate(m.attention[-1][2])}")
    m.copy_bps = groups["copy"][0].rate
    pw = groups["pointwise"]
    m.pointwise_bps = sum(p.work for p in pw) / sum(p.seconds for p in pw)
    m.kernel_overhead_s = groups["overhead"][0].seconds
    progress(f"{groups['copy'][0].label}: {m.copy_bps / 1e9:.2f} GB/s")
    for p in pw:
        progress(f"{p.label}: {p.rate / 1e9:.2f} GB/s")
    progress(f"kernel overhead (16x16x16 GEMM): {m.kernel_overhead_s * 1e6:.1f} us")


def _collectives(m: Measurements, quick: bool, progress: Callable[[str], None]) -> None:
    import torch

    dev = m.device
    world = min(torch.cuda.device_count(), 8) if dev.kind == "cuda" else 2
    backend = "nccl" if dev.kind == "cuda" else "gloo"
    if world < 2:
        m.collectives_skipped = "one GPU on this node: no collective to measure"
        progress(f"collectives: skipped: {m.collectives_skipped}")
        return
    nbytes = _sizes(dev, quick)[1]
    t = time.perf_counter()
    try:
        m.collectives = c = collectives.measure(world, backend, nbytes, m.passes)
    except Exception as e:  # a spawned rank's failure arrives as any exception type
        raise CannotMeasure(f"collectives ({backend}, {world} ranks): {type(e).__name__}: {e}") from e
    lat = f"{c['base_latency_s'] * 1e6:.0f} + {c['step_latency_s'] * 1e6:.0f} us/step"
    progress(
        f"collectives ({backend}, {world} local ranks, {nbytes >> 20} MiB): bus bandwidth "
        f"{c['busbw'] / 1e9:.3g} GB/s, latency {lat} ({time.perf_counter() - t:.0f} s)"
    )


def measure_all(
    dev: Device,
    quick: bool = False,
    kinds: tuple[str, ...] | None = None,
    progress: Callable[[str], None] = print,
    reuse_collectives: dict | None = None,
) -> Measurements:
    """Run every benchmark of the device (`kinds`: the GEMM kernel families to measure, default
    every one it runs; `reuse_collectives`: an earlier measurement's collectives, not run again);
    CannotMeasure naming the first that fails."""
    from core import cpu_gemm

    t0 = time.perf_counter()
    m, cfgs = _new(dev, quick, kinds)
    for kind, why in m.skipped.items():
        progress(f"skipped: gemm {kind}: {why}")
    route = cpu_gemm.resolve("auto", dev.torch_device, "bfloat16")  # the trainer's bf16 GEMM route
    with cpu_gemm.using(route) if dev.kind == "cpu" else contextlib.nullcontext():
        groups = _probes(m, cfgs, quick)
        probes = [p for g in groups.values() for p in g]
        progress(f"{len(probes)} benchmarks ({m.configs}), {m.passes} interleaved passes:")
        B.run_probes(dev, probes, m.passes, progress)
    _record(m, groups, progress)
    if reuse_collectives:
        m.collectives = reuse_collectives
        progress("collectives: the earlier measurement's (not run again)")
    else:
        _collectives(m, quick, progress)
    m.wall_s = time.perf_counter() - t0
    return m
