"""A measured device as a GPU spec (the format of core/dryrun/hardware/, docs/dry-run.md).

Where a shipped spec of the same GPU exists (`device.base_spec`, or --base), its datasheet peaks
stay and the measurements become the efficiencies beside them: GEMM points, attention forward and
backward, the pointwise kernels' bandwidth, NCCL inside the node; what one node cannot measure
(the network) and the fitted sustained clock stay the base's, and say so. Without a base (a CPU,
or a GPU we have no spec of) each "peak" is the best rate measured of its kind and every
efficiency a fraction of it: compute peak = the fastest of the GEMMs and attention kernels
measured, bandwidth peak = the faster of the copy and the pointwise kernels, link peak = the
fastest collective's bus bandwidth. Every number measured here is listed in [measured].fields.
"""

from __future__ import annotations

import datetime
import re

from core.dryrun.gpuspec import GPUSpec, load_spec, spec_toml
from recipes.gpu_spec.run import Measurements


def _frac(x: float, peak: float) -> float:
    """A measured rate as a fraction of its peak, at most 1 (a GPU above its datasheet: boost)."""
    return min(1.0, x / peak)


def default_name(m: Measurements) -> str:
    slug = re.sub(r"[^a-z0-9]+", "_", m.device.name.lower()).strip("_")
    return f"measured_{slug[:48].rstrip('_')}"


class _Doc:
    """The spec being written: its sections, the comments of its numbers and the fields measured."""

    def __init__(self, base: GPUSpec | None):
        self.base = base
        self.sections: dict[str, dict] = {s: {} for s in ("compute", "memory", "links", "efficiency")}
        self.notes: dict[str, str] = {}
        self.measured: list[str] = []

    def put(self, key: str, value, note: str, measured: bool = True) -> None:
        section, field = key.split(".")
        self.sections[section][field] = value
        self.notes[key] = note
        if measured:
            self.measured.append(key)

    def keep(self, key: str, why: str) -> None:
        """A number one device cannot measure: the base spec's."""
        assert self.base is not None
        self.put(key, getattr(self.base, key.split(".")[1]), f"from {self.base.name} ({why})", measured=False)


def _compute(doc: _Doc, m: Measurements, when: str) -> tuple[float, float]:
    """[compute]; returns the (bf16, fp8) peaks every efficiency is a fraction of."""
    bf16_best = max(r for *_, r in m.gemm["bf16"])
    attn_best = max(max(f, b) for _, f, b in m.attention)
    fp8_rates = [r for k in ("fp8_tensorwise", "fp8_rowwise") for *_, r in m.gemm.get(k, [])]
    if doc.base:
        doc.keep("compute.peak_bf16_flops", "datasheet")
        doc.keep("compute.peak_fp8_flops", "datasheet")
        doc.keep("compute.clock_fraction", "the sustained clock of a training run over a microbenchmark's")
        peaks = doc.base.peak_bf16_flops, doc.base.peak_fp8_flops
    else:
        bf16 = max(bf16_best, attn_best)
        doc.put("compute.peak_bf16_flops", bf16, f"measured {when}: the fastest bf16 GEMM or attention kernel below")
        if fp8_rates:
            doc.put("compute.peak_fp8_flops", max(fp8_rates), f"measured {when}: the fastest float8 GEMM below")
        else:
            doc.put(
                "compute.peak_fp8_flops",
                bf16,
                "no float8 GEMM on this device: the bf16 peak (no [gemm] float8 table: the model refuses Float8)",
                measured=False,
            )
        doc.put("compute.clock_fraction", 1.0, "the rates below are measured as this device runs", measured=False)
        peaks = bf16, doc.sections["compute"]["peak_fp8_flops"]
    doc.put(
        "compute.kernel_overhead_s",
        m.kernel_overhead_s,
        f"measured {when}: seconds of a 16x16x16 bf16 GEMM (launch / dispatch; bf16 route on a CPU)",
    )
    return peaks


def _memory(doc: _Doc, m: Measurements, when: str) -> None:
    if doc.base:
        doc.keep("memory.hbm_bandwidth", "datasheet")
        doc.keep("memory.hbm_capacity_gib", "what torch can reserve of the datasheet's memory")
        peak = doc.base.hbm_bandwidth
    else:
        peak = max(m.copy_bps, m.pointwise_bps)
        doc.put(
            "memory.hbm_bandwidth",
            peak,
            f"measured {when}: bytes/s of a bf16 copy of a large tensor (or of the pointwise kernels, if faster)",
        )
        what = "RAM per process of this CPU" if m.device.kind == "cpu" else "the GPU's memory as torch reports it"
        doc.put("memory.hbm_capacity_gib", round(m.device.memory_gib, 1), f"read {when}: {what}")
    doc.put(
        "efficiency.hbm",
        _frac(m.pointwise_bps, peak),
        f"measured {when}: the eager pointwise kernels (bf16 x bf16, casts to and from fp32, fp32 x fp32) "
        f"at {m.pointwise_elements:,} elements, {m.pointwise_bps / 1e9:.3g} GB/s",
    )


def _links(doc: _Doc, m: Measurements, when: str) -> None:
    c = m.collectives
    if doc.base:
        for k in ("network_bandwidth", "network_latency_s", "gpus_per_node"):
            doc.keep(f"links.{k}", "one node cannot measure it")
        doc.keep("efficiency.nccl_rdma", "one node cannot measure it")
        if c is None:
            for k in ("links.nvlink_bandwidth", "links.collective_base_latency_s", "links.nvlink_latency_s"):
                doc.keep(k, m.collectives_skipped)
            doc.keep("efficiency.nccl_nvlink", m.collectives_skipped)
            return
        doc.keep("links.nvlink_bandwidth", "datasheet")
        peak = doc.base.nvlink_bandwidth
    else:
        assert c is not None, "a spec without a base needs the collectives measured"
        peak = c["peak_busbw"]
        doc.put("links.nvlink_bandwidth", peak, f"measured {when}: the fastest collective's bus bandwidth below")
        local = f"not measured (one node): the {c['backend']} figures of the local ranks stand in"
        doc.put("links.network_bandwidth", peak, local, measured=False)
        doc.put("links.network_latency_s", c["step_latency_s"], local, measured=False)
        doc.put("efficiency.nccl_rdma", _frac(c["busbw"], peak), local, measured=False)
        per_node = c["world"] if m.device.kind == "cuda" else max(1, _cpu_count() // m.device.threads)
        doc.put("links.gpus_per_node", per_node, "devices of this node", measured=False)
    ops = ", ".join(f"{op} {c[op]['busbw'] / 1e9:.3g} GB/s" for op in ("all_gather", "reduce_scatter", "all_reduce"))
    doc.put(
        "efficiency.nccl_nvlink",
        _frac(c["busbw"], peak),
        f"measured {when}: {c['backend']} over {c['world']} local ranks, {c['bytes'] >> 20} MiB: bus bandwidth {ops}; "
        "ring collectives (all-gather, reduce-scatter) over the peak",
    )
    doc.put("links.collective_base_latency_s", c["base_latency_s"], f"measured {when}: tiny all-gather and all-reduce")
    doc.put("links.nvlink_latency_s", c["step_latency_s"], f"measured {when}: tiny all-gather and all-reduce")


def _cpu_count() -> int:
    import os

    return os.cpu_count() or 1


def _attention(doc: _Doc, m: Measurements, peak: float, when: str) -> None:
    seq, fwd, bwd = min(m.attention, key=lambda a: abs(a[0] - m.attention_seq))
    batch, heads, hd, fp32 = m.attention_shape
    each = "; ".join(f"seq {s}: {f / 1e9:.3g} / {b / 1e9:.3g} GFLOP/s" for s, f, b in m.attention)
    what = f"SDPA causal {'fp32' if fp32 else 'bf16'}, {batch} x {heads} heads x {hd}, forward / backward: {each}"
    doc.put("efficiency.flash_attention_fwd", _frac(fwd, peak), f"measured {when} at seq {seq}: {what}")
    doc.put(
        "efficiency.flash_attention_bwd",
        _frac(bwd, peak),
        f"measured {when} at seq {seq} (backward 2.5 x the forward's FLOPs)",
    )


def _gemm_tables(m: Measurements, peaks: tuple[float, float], date: str) -> dict:
    route = " through the trainer's bf16 route (core/cpu_gemm.py)" if m.device.kind == "cpu" else ""
    tables = {}
    for kind, points in m.gemm.items():
        peak = peaks[0] if kind == "bf16" else peaks[1]
        call = "torch.mm bf16" if kind == "bf16" else f"torch._scaled_mm {kind[4:]} float8_e4m3fn, fast accumulation"
        tables[kind] = [
            {
                "m": a,
                "n": b,
                "k": c,
                "efficiency": _frac(r, peak),
                "source": f"run-recipe gpu-spec --measure on {m.device.name}, torch {m.device.torch_version}: "
                f"{call}{route}, trimmed mean of {m.passes} interleaved passes: {r / 1e9:.4g} GFLOP/s",
                "measured": date,
            }
            for a, b, c, r in points
        ]
    return tables


def spec_document(m: Measurements, name: str, base: str | None) -> tuple[str, GPUSpec]:
    """The spec file's text and the spec it loads as (the same validation as a shipped one)."""
    base_spec = load_spec(base) if base else None
    date = datetime.date.today().isoformat()
    when = f"{date} on {m.device.name}"
    doc = _Doc(base_spec)
    peaks = _compute(doc, m, when)
    _memory(doc, m, when)
    _links(doc, m, when)
    _attention(doc, m, peaks[0], when)
    gemm = _gemm_tables(m, peaks, date)
    skipped = "; ".join(f"{k}: {why}" for k, why in m.skipped.items())
    description = f"{m.device.name}, measured by run-recipe gpu-spec --measure ({m.configs})" + (
        f"; datasheet peaks and the network from {base}" if base else "; every peak measured here"
    )
    calibration = (
        f"compute.clock_fraction from {base}: {base_spec.calibration}" if base_spec and base_spec.calibration else ""
    )
    data = {
        "name": name,
        "description": description,
        **({"calibration": calibration} if calibration else {}),
        "measured": {
            "date": date,
            "device": m.device.name,
            "torch": m.device.torch_version,
            "driver": m.device.driver,
            "threads": m.device.threads,
            "fields": doc.measured + [f"gemm.{k}" for k in gemm],
            **({"skipped": skipped} if skipped else {}),
        },
        **doc.sections,
        "gemm": gemm,
    }
    header = (
        f"Written by `run-recipe gpu-spec --measure` on {date} in {m.wall_s:.0f} s (docs/gpu-spec.md).\n"
        f"Device: {m.device.name}; torch {m.device.torch_version}; {m.device.driver}."
        + (f"\nNot measured: {skipped}" if skipped else "")
    )
    return spec_toml(data, doc.notes, header)
