"""GPU systems as data: one TOML file per system in core/dryrun/hardware/ (peak FLOP/s, HBM,
links, latencies and the achieved-efficiency constants, each number with its source in a
comment), loaded and checked here. Torch-free, so the layout advisor can load it cheaply."""

from __future__ import annotations

import dataclasses
import functools
from importlib import resources

import tomllib

DEFAULT_GPU = "h100_96gb_hbm2e_500w"

# (section, field) of every required number; efficiencies must also be at most 1.
FIELDS = {
    "compute": ("peak_bf16_flops", "peak_fp8_flops", "clock_fraction"),
    "memory": ("hbm_bandwidth", "hbm_capacity_gib"),
    "links": (
        "nvlink_bandwidth",
        "network_bandwidth",
        "gpus_per_node",
        "collective_base_latency_s",
        "nvlink_latency_s",
        "network_latency_s",
    ),
    "efficiency": (
        "gemm_bf16",
        "gemm_fp8",
        "flash_attention_fwd",
        "flash_attention_bwd",
        "hbm",
        "nccl_nvlink",
        "nccl_rdma",
    ),
}


class SpecError(ValueError):
    """A GPU spec that is unknown or malformed; the message names the file and field."""


@dataclasses.dataclass(frozen=True)
class GPUSpec:
    name: str
    description: str
    peak_bf16_flops: float
    peak_fp8_flops: float
    clock_fraction: float
    hbm_bandwidth: float
    hbm_capacity_gib: float
    nvlink_bandwidth: float
    network_bandwidth: float
    gpus_per_node: int
    collective_base_latency_s: float
    nvlink_latency_s: float
    network_latency_s: float
    gemm_bf16: float
    gemm_fp8: float
    flash_attention_fwd: float
    flash_attention_bwd: float
    hbm: float
    nccl_nvlink: float
    nccl_rdma: float
    calibration: str = ""


def _dir():
    return resources.files("core.dryrun") / "hardware"


def known_gpus() -> list[str]:
    return sorted(f.name[:-5] for f in _dir().iterdir() if f.name.endswith(".toml"))


def parse_spec(data: dict, where: str) -> GPUSpec:
    """A GPUSpec from a parsed TOML document; SpecError naming the first bad field."""
    values = {}
    for section, names in FIELDS.items():
        sec = data.get(section)
        if not isinstance(sec, dict):
            raise SpecError(f"{where}: missing section [{section}]")
        for n in names:
            key = f"{section}.{n}"
            if n not in sec:
                raise SpecError(f"{where}: missing field {key}")
            v = sec[n]
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
                raise SpecError(f"{where}: field {key} must be a positive number, got {v!r}")
            if section == "efficiency" and v > 1:
                raise SpecError(f"{where}: field {key} is a fraction of peak and must be <= 1, got {v!r}")
            values[n] = v
    if values["clock_fraction"] > 1:
        raise SpecError(f"{where}: field compute.clock_fraction must be <= 1, got {values['clock_fraction']!r}")
    if int(values["gpus_per_node"]) != values["gpus_per_node"]:
        raise SpecError(f"{where}: field links.gpus_per_node must be an integer")
    values["gpus_per_node"] = int(values["gpus_per_node"])
    name = data.get("name")
    if not isinstance(name, str) or not name:
        raise SpecError(f"{where}: missing field name")
    return GPUSpec(
        name=name, description=str(data.get("description", "")), calibration=str(data.get("calibration", "")), **values
    )


@functools.cache
def load_spec(name: str = DEFAULT_GPU) -> GPUSpec:
    """The named spec (file core/dryrun/hardware/<name>.toml); SpecError listing the known names."""
    known = known_gpus()
    if name not in known:
        raise SpecError(f"unknown GPU spec {name!r}; known: {', '.join(known)}")
    f = _dir() / f"{name}.toml"
    try:
        data = tomllib.loads(f.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as e:
        raise SpecError(f"{name}.toml: cannot parse: {e}") from None
    return parse_spec(data, f"{name}.toml")
