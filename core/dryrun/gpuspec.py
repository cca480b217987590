"""GPU systems as data: one TOML file per system in core/dryrun/hardware/ (datasheet peaks, HBM,
links, latencies, the measured rates of GEMMs by shape and of the other kernels, each number with
its source), loaded and checked here. Torch-free, so the layout advisor can load it cheaply.

The format (docs/dry-run.md, "The GPU spec format"; `run-recipe gpu-spec --measure` writes the
same):

- [compute], [memory], [links], [efficiency]: one positive number per field, its source in a
  comment; efficiencies are fractions of the datasheet figure beside them (<= 1). A part with
  no FP8 tensor cores leaves out `compute.peak_fp8_flops` (and has no float8 [gemm] table):
  Float8 is refused on it; `compute.compute_capability` ("8.0") names the CUDA architecture;
- [gemm]: for each GEMM kernel family (`bf16`, `fp8_tensorwise`, `fp8_rowwise`) a small table
  of measured points `{m, n, k, efficiency, source, measured?}`: the fraction of the dtype's
  datasheet peak a GEMM of that shape reached. A family the spec has no table for is a recipe
  the model refuses on that GPU (core/dryrun/gemm.py);
- [float8_linear] (optional): `<recipe> = "<grid>"` (recipe `rowwise`) names a measured grid of
  that Float8 recipe's whole-linear speedup over bf16 by forward shape, a file of
  core/dryrun/grids/ (`{source, m, k, n, speedup}`, one row of speedups, one per n, for each
  (m, k), m-major) that specs of the same kernels share. The model takes a linear's time under
  that recipe from it wherever its own pricing is faster (core/dryrun/linears.py
  `measured_excess`);
- [measured] (a measured spec only): the date, device, torch and driver of the measurement and
  the `fields` it measured; every other number came from the spec it started from.

A spec is named (a file of core/dryrun/hardware/) or given by its path (a `.toml` file, e.g. the
one `run-recipe gpu-spec --measure --out FILE` wrote): both pass the same validation.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re
from importlib import resources
from pathlib import Path
from typing import Any, TypeGuard

import tomllib

DEFAULT_GPU = "h100_96gb_hbm2e_500w"

# (section, field) of every required number; efficiencies must also be at most 1.
FIELDS = {
    "compute": ("peak_bf16_flops", "peak_fp8_flops", "clock_fraction", "kernel_overhead_s"),
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
        "flash_attention_fwd",
        "flash_attention_bwd",
        "hbm",
        "nccl_nvlink",
        "nccl_rdma",
        "cudnn_attention_fwd",
        "cudnn_attention_bwd",
    ),
}
GEMM_KINDS = ("bf16", "fp8_tensorwise", "fp8_rowwise")
# Absent on a part without FP8 tensor cores (0.0: none); cuDNN's attention rates where a spec has
# no measurement of them (0.0: a software stack that runs cuDNN attention is priced at flash's).
OPTIONAL = {"compute.peak_fp8_flops", "efficiency.cudnn_attention_fwd", "efficiency.cudnn_attention_bwd"}
GEMM_POINT_DIMS = ("m", "n", "k")
MEASURED_KEYS = ("date", "device", "torch", "driver")  # the [measured] table's strings
LINEAR_TABLE_RECIPES = ("rowwise",)  # recipes a [float8_linear] table may describe


class SpecError(ValueError):
    """A GPU spec that is unknown or malformed; the message names the file and field."""


@dataclasses.dataclass(frozen=True)
class GemmPoint:
    """One measured GEMM: its shape and the fraction of the dtype's datasheet peak it reached."""

    m: int
    n: int
    k: int
    efficiency: float
    source: str
    measured: str = ""  # the date of a measurement (`run-recipe gpu-spec --measure`)


@dataclasses.dataclass(frozen=True)
class LinearSpeedups:
    """A measured grid: a Float8 recipe's linear (forward + backward) over the bf16 one, by the
    forward's M x K -> N."""

    m: tuple[int, ...]
    k: tuple[int, ...]
    n: tuple[int, ...]
    speedup: tuple[tuple[float, ...], ...]  # one row per (m, k), m-major; one value per n
    source: str


@dataclasses.dataclass(frozen=True)
class GPUSpec:
    name: str
    description: str
    peak_bf16_flops: float
    peak_fp8_flops: float  # 0.0: the part has no FP8 tensor cores
    clock_fraction: float
    kernel_overhead_s: float
    hbm_bandwidth: float
    hbm_capacity_gib: float
    nvlink_bandwidth: float
    network_bandwidth: float
    gpus_per_node: int
    collective_base_latency_s: float
    nvlink_latency_s: float
    network_latency_s: float
    flash_attention_fwd: float
    flash_attention_bwd: float
    hbm: float
    nccl_nvlink: float
    nccl_rdma: float
    cudnn_attention_fwd: float = 0.0  # 0.0: not measured on this part (priced as flash attention)
    cudnn_attention_bwd: float = 0.0
    # (kind, measured points) for each GEMM kernel family the spec has a table for
    gemm: tuple[tuple[str, tuple[GemmPoint, ...]], ...] = ()
    calibration: str = ""
    measured: str = ""  # a measured spec: "<date> on <device>, torch <version>, <driver>"
    # (recipe, measured whole-linear speedups) for each recipe the spec has a table for
    float8_linear: tuple[tuple[str, LinearSpeedups], ...] = ()
    compute_capability: str = ""  # CUDA's, e.g. "9.0" (optional)

    def gemm_points(self, kind: str) -> tuple[GemmPoint, ...]:
        return dict(self.gemm).get(kind, ())

    def linear_speedups(self, recipe: str) -> LinearSpeedups | None:
        return dict(self.float8_linear).get(recipe)


def _dir():
    return resources.files("core.dryrun") / "hardware"


def known_gpus() -> list[str]:
    return sorted(f.name[:-5] for f in _dir().iterdir() if f.name.endswith(".toml"))


def _positive(v: object) -> TypeGuard[float]:
    return not isinstance(v, bool) and isinstance(v, (int, float)) and v > 0


def _gemm_point(p, key: str, where: str) -> GemmPoint:
    if not isinstance(p, dict):
        raise SpecError(f"{where}: field {key} must be a table {{m, n, k, efficiency, source}}")
    for d in GEMM_POINT_DIMS:
        if not (_positive(p.get(d)) and int(p[d]) == p[d]):
            raise SpecError(f"{where}: field {key}.{d} must be a positive integer, got {p.get(d)!r}")
    eff = p.get("efficiency")
    if not _positive(eff) or float(eff) > 1:
        raise SpecError(f"{where}: field {key}.efficiency must be a fraction of peak in (0, 1], got {eff!r}")
    src = p.get("source")
    if not isinstance(src, str) or not src.strip():
        raise SpecError(f"{where}: field {key}.source must name where the number comes from")
    return GemmPoint(int(p["m"]), int(p["n"]), int(p["k"]), float(eff), src.strip(), str(p.get("measured", "")))


def _gemm_tables(data: dict, where: str) -> tuple:
    sec = data.get("gemm")
    if not isinstance(sec, dict):
        raise SpecError(f"{where}: missing section [gemm]")
    unknown = sorted(set(sec) - set(GEMM_KINDS))
    if unknown:
        raise SpecError(f"{where}: unknown GEMM kind gemm.{unknown[0]} (known: {', '.join(GEMM_KINDS)})")
    if "bf16" not in sec:
        raise SpecError(f"{where}: missing field gemm.bf16")
    tables = []
    for kind in GEMM_KINDS:
        if kind not in sec:
            continue
        points = sec[kind]
        if not isinstance(points, list) or not points:
            raise SpecError(f"{where}: field gemm.{kind} must be a non-empty list of measured points")
        tables.append((kind, tuple(_gemm_point(p, f"gemm.{kind}[{i}]", where) for i, p in enumerate(points))))
    return tuple(tables)


def _axis(v: object, key: str, where: str) -> tuple[int, ...]:
    if not (isinstance(v, list) and v and all(_positive(x) and int(x) == x for x in v) and sorted(set(v)) == v):
        raise SpecError(f"{where}: field {key} must be an ascending list of positive integers, got {v!r}")
    return tuple(int(x) for x in v)


def parse_grid(t: object, where: str) -> LinearSpeedups:
    """A measured linear-speedup grid from its parsed TOML; SpecError naming the bad field."""
    if not isinstance(t, dict):
        raise SpecError(f"{where}: a grid must be a table {{source, m, k, n, speedup}}")
    m, k, n = (_axis(t.get(d), d, where) for d in "mkn")
    rows = t.get("speedup")
    if not isinstance(rows, list) or len(rows) != len(m) * len(k):
        rows = None
    if not rows or not all(isinstance(r, list) and len(r) == len(n) and all(map(_positive, r)) for r in rows):
        raise SpecError(f"{where}: field speedup must hold {len(m) * len(k)} rows of {len(n)} positive numbers")
    src = t.get("source")
    if not isinstance(src, str) or not src.strip():
        raise SpecError(f"{where}: field source must name where the numbers come from")
    return LinearSpeedups(m, k, n, tuple(tuple(map(float, r)) for r in rows), src.strip())


def known_grids() -> list[str]:
    return sorted(f.name[:-5] for f in (resources.files("core.dryrun") / "grids").iterdir() if f.name.endswith(".toml"))


@functools.cache
def load_grid(name: str) -> LinearSpeedups:
    """The grid core/dryrun/grids/<name>.toml, shared by the specs that name it."""
    text = (resources.files("core.dryrun") / "grids" / f"{name}.toml").read_text(encoding="utf-8")
    return parse_grid(tomllib.loads(text), f"grids/{name}.toml")


def _linear_tables(data: dict, where: str) -> tuple:
    """The optional [float8_linear] table: recipe -> the name of a measured grid (core/dryrun/grids)."""
    sec = data.get("float8_linear", {})
    if not isinstance(sec, dict) or any(r not in LINEAR_TABLE_RECIPES for r in sec):
        raise SpecError(f"{where}: [float8_linear] takes grids for {', '.join(LINEAR_TABLE_RECIPES)}, got {sec!r}")
    out = []
    for recipe, name in sec.items():
        if name not in known_grids():
            raise SpecError(
                f"{where}: field float8_linear.{recipe} must name a grid of core/dryrun/grids "
                f"({', '.join(known_grids())}), got {name!r}"
            )
        out.append((recipe, load_grid(name)))
    return tuple(out)


def parse_spec(data: dict, where: str) -> GPUSpec:
    """A GPUSpec from a parsed TOML document; SpecError naming the first bad field."""
    values: dict[str, Any] = {}  # the numeric fields, checked below
    for section, names in FIELDS.items():
        sec = data.get(section)
        if not isinstance(sec, dict):
            raise SpecError(f"{where}: missing section [{section}]")
        for n in names:
            key = f"{section}.{n}"
            if n not in sec and key in OPTIONAL:
                values[n] = 0.0
                continue
            if n not in sec:
                raise SpecError(f"{where}: missing field {key}")
            v = sec[n]
            if not _positive(v):
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
    gemm = _gemm_tables(data, where)
    fp8 = [k for k, _ in gemm if k != "bf16"]
    if fp8 and not values["peak_fp8_flops"]:
        raise SpecError(f"{where}: field gemm.{fp8[0]} needs compute.peak_fp8_flops (the FP8 peak it is a fraction of)")
    cc = data["compute"].get("compute_capability", "")
    if not isinstance(cc, str) or (cc and not re.fullmatch(r"\d+\.\d+", cc)):
        raise SpecError(f'{where}: field compute.compute_capability must be CUDA\'s, e.g. "9.0", got {cc!r}')
    return GPUSpec(
        name=name,
        description=str(data.get("description", "")),
        calibration=str(data.get("calibration", "")),
        gemm=gemm,
        measured=_measured(data, where, {k for k, _ in gemm}),
        float8_linear=_linear_tables(data, where),
        compute_capability=cc,
        **values,
    )


def _measured(data: dict, where: str, kinds: set[str]) -> str:
    """The [measured] table of a measured spec, checked, as one line ("" for a spec without)."""
    sec = data.get("measured")
    if sec is None:
        return ""
    if not isinstance(sec, dict):
        raise SpecError(f"{where}: [measured] must be a table")
    for key in MEASURED_KEYS:
        if not isinstance(sec.get(key), str) or not sec[key].strip():
            raise SpecError(f"{where}: field measured.{key} must name the measurement's {key}")
    if not re.fullmatch(r"\d{4}-\d{2}-\d{2}", sec["date"]):
        raise SpecError(f"{where}: field measured.date must be a date YYYY-MM-DD, got {sec['date']!r}")
    fields = sec.get("fields")
    known = {f"{s}.{n}" for s, names in FIELDS.items() for n in names} | {f"gemm.{k}" for k in kinds}
    if not isinstance(fields, list) or not fields or not all(isinstance(f, str) for f in fields):
        raise SpecError(f"{where}: field measured.fields must list the numbers measured")
    unknown = [f for f in fields if f not in known]
    if unknown:
        raise SpecError(f"{where}: field measured.fields names {unknown[0]!r}, not a number of this spec")
    return f"{sec['date']} on {sec['device']}, torch {sec['torch']}, {sec['driver']}"


def is_spec_file(name: str) -> bool:
    """Whether --gpu names a spec file (a path) rather than a spec of core/dryrun/hardware/."""
    return name.endswith(".toml") or "/" in name


def load_spec(name: str = DEFAULT_GPU) -> GPUSpec:
    """The named spec (file core/dryrun/hardware/<name>.toml) or the spec file at a path (see
    `is_spec_file`); SpecError listing the known names, or naming the file and its bad field."""
    if is_spec_file(name):
        path = Path(name).expanduser()
        if not path.is_file():
            raise SpecError(f"GPU spec file {name} does not exist (known spec names: {', '.join(known_gpus())})")
        stat = path.stat()  # the file may be rewritten (a new measurement): cached per version
        return _load_file(str(path.resolve()), stat.st_mtime_ns, stat.st_size)
    return _load_named(name)


def _parse_text(text: str, where: str) -> GPUSpec:
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise SpecError(f"{where}: cannot parse: {e}") from None
    return parse_spec(data, where)


@functools.cache
def _load_named(name: str) -> GPUSpec:
    known = known_gpus()
    if name not in known:
        raise SpecError(f"unknown GPU spec {name!r}; known: {', '.join(known)} (or a spec file's path)")
    return _parse_text((_dir() / f"{name}.toml").read_text(encoding="utf-8"), f"{name}.toml")


@functools.cache
def _load_file(path: str, mtime_ns: int, size: int) -> GPUSpec:
    return _parse_text(Path(path).read_text(encoding="utf-8"), path)


# =============================================================================================
# Writing a spec (`run-recipe gpu-spec --measure`)
# =============================================================================================
def _toml_value(v: object) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        return f"{v:.6g}"  # six digits: a measurement's own spread is wider
    if isinstance(v, str):
        return json.dumps(v, ensure_ascii=False)  # a TOML basic string: JSON's escapes are TOML's
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    raise TypeError(f"no TOML form for {type(v).__name__}")


def _toml_lines(key: str, v: object, notes: dict[str, str], where: str) -> list[str]:
    note = notes.get(where)
    return ([f"# {line}" for line in note.splitlines()] if note else []) + [f"{key} = {_toml_value(v)}"]


def spec_toml(doc: dict, notes: dict[str, str] | None = None, header: str = "") -> tuple[str, GPUSpec]:
    """A spec document (the parsed form: top-level strings, the tables of FIELDS and [measured],
    [gemm] lists of points) as TOML, and the spec that text loads as (the same validation as a
    shipped spec); `notes` {"section.field": text} become comments above the numbers (their
    sources), `header` the file's opening comment."""
    notes = notes or {}
    out = [f"# {line}" for line in header.splitlines()]
    tables = {k: v for k, v in doc.items() if isinstance(v, dict)}
    for key, v in doc.items():
        if key not in tables:
            out += _toml_lines(key, v, notes, key)
    for section, values in tables.items():
        if section == "gemm":
            continue
        out += ["", f"[{section}]"]
        for key, v in values.items():
            out += _toml_lines(key, v, notes, f"{section}.{key}")
    for kind, points in tables.get("gemm", {}).items():
        for point in points:
            out += ["", f"[[gemm.{kind}]]"] + [f"{k} = {_toml_value(v)}" for k, v in point.items()]
    text = "\n".join(out) + "\n"
    return text, _parse_text(text, doc.get("name", "spec"))  # what is written loads as it is read
