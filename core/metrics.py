"""Throughput, FLOPs, MFU, memory and loss logging.

FLOPs per token (torchtitan's convention, stated in the README):
    6 * (N - N_embedding) + 12 * L * H * (D / H) * T
N parameters, L layers, H heads, D model dim, T sequence length. The first term is the
forward+backward matmuls of every weight (the output projection counts as a weight), the second
attention's score and value matmuls; causal masking is not discounted.
MFU = FLOPs/token * tokens/s per device / peak FLOP/s of one device.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import re
import resource
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from core import cpu_gemm
from core.fileio import atomic_write, atomic_write_json
from core.logs import PROGRESS_TTY_ENV, get_logger
from core.models.args import ModelArgs, param_count

log = get_logger(__name__)

# Peak dense bf16 FLOP/s per device (vendor figures), by the GPU model `gpu_model` reads from
# the device's name. A model not here (H200 NVL, GB200, H800, L40S, ...) gets no peak and so no
# MFU, never another model's figure: metrics.peak_flops gives one.
PEAK_FLOPS = {
    "H100 SXM": 989e12,
    "H100 NVL": 835e12,
    "H100 PCIe": 756e12,
    "H200 SXM": 989e12,
    "A100 SXM": 312e12,
    "A100 PCIe": 312e12,
    "B200 SXM": 2.25e15,
    "MI300X": 1.3e15,
    "MI325X": 1.3e15,  # the MI300X's compute die (core/dryrun/hardware/mi325x.toml)
    "MI355X": 2.5e15,  # dense BF16 (core/dryrun/hardware/mi355x.toml)
}
# The names CUDA and ROCm report, matched whole: the vendor, the model (one word), then only
# words that say the form factor or the memory ("NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-80GB",
# "NVIDIA H100 PCIe", "AMD Instinct MI300X VF"). Any other word makes it another part.
GPU_NAME = re.compile(
    r"(?:NVIDIA|AMD Instinct) (?P<model>[A-Z]+\d+[A-Z]?)(?P<rest>(?:[- ](?:SXM\d?|PCIe|NVL|\d+GB|HBM\w*|VF))*)",
    re.IGNORECASE,
)


def gpu_model(name: str) -> str | None:
    """The model a device name reports, as PEAK_FLOPS names it: NVIDIA's with its form factor
    (NVL, PCIe, else SXM: 'NVIDIA H200 NVL' -> 'H200 NVL'), AMD's as it is; None for a name
    outside GPU_NAME's pattern."""
    m = GPU_NAME.fullmatch(name.strip())
    if m is None:
        return None
    model, words = m["model"].upper(), m["rest"].upper().replace("-", " ").split()
    if name.strip().upper().startswith("AMD"):
        return model
    return f"{model} {'NVL' if 'NVL' in words else 'PCIe' if 'PCIE' in words else 'SXM'}"


def flops_per_token(args: ModelArgs, seq_len: int) -> float:
    n = param_count(args)
    n_emb = args.vocab_size * args.dim
    head_dim = args.dim // args.n_heads
    return 6 * (n - n_emb) + 12 * args.n_layers * args.n_heads * head_dim * seq_len


def cuda_peak_flops(name: str) -> float | None:
    """The vendor's dense bf16 peak of a GPU this table knows; None for any other (an H800, H20,
    H200 NVL, GB200, L40S ...: MFU then needs metrics.peak_flops, never a guess)."""
    return PEAK_FLOPS.get(gpu_model(name) or "")


def measure_cpu_peak_flops(dtype: torch.dtype = torch.bfloat16, max_n: int = 2048, repeats: int = 5) -> float:
    """Best of a few square matmuls on this process's threads: the CPU 'peak' for MFU. The size
    doubles from 256 while one matmul takes under 50 ms (a CPU's scalar bf16 fallback runs a
    2048 matmul for minutes)."""
    n = 256
    while True:
        a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
        t = time.perf_counter()
        a @ b  # also the warm-up
        if n >= max_n or time.perf_counter() - t > 0.05:
            break
        n *= 2
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t)
    return 2 * n**3 / best


def _peak_cache(cache_dir: str | None = None) -> Path:
    folder = Path(cache_dir or os.environ.get("TITAN_CACHE", Path.home() / ".cache" / "titan_recipes"))
    return folder / "cpu_peak_flops.json"


def cpu_peak_flops(dtype: str = "bfloat16", cache_dir: str | None = None) -> float:
    """Measured once per machine, dtype, thread count and bf16 GEMM route (core.cpu_gemm), cached
    as JSON. A launch that forks its ranks measures it before the fork (core.lazy_imports), alone:
    ranks measuring side by side would share the cores and cache a peak their steps then beat."""
    key = f"{dtype}-threads{torch.get_num_threads()}-{os.cpu_count()}cpu"
    if dtype == "bfloat16" and cpu_gemm.active() == "fp32":
        key += "-fp32gemm"
    path = _peak_cache(cache_dir)
    table = json.loads(path.read_text()) if path.is_file() else {}
    if key not in table:
        table[key] = measure_cpu_peak_flops(getattr(torch, dtype))
        atomic_write_json(path, table)
    return table[key]


def forget_cpu_peak(cache_dir: str | None = None) -> None:
    """A step beat the cached CPU peak (MFU over 100%): it was measured under contention. Dropped,
    so the next launch measures it again (this run's figures keep the peak they were made with)."""
    with contextlib.suppress(OSError):
        _peak_cache(cache_dir).unlink()


@dataclass(frozen=True)
class PeakFlops:
    """An MFU denominator and what it is: its source, and on a CPU the bf16 GEMM route it was
    measured on (core.cpu_gemm), which must be the route the steps ran."""

    flops: float | None
    source: str
    gemm_route: str | None  # "native" | "fp32" on a CPU; None: not measured here


def cpu_peak(dtype: str) -> PeakFlops:
    """This CPU's peak for `dtype` on the GEMM route active now (the one the steps run)."""
    route = cpu_gemm.active() if dtype == "bfloat16" else "native"
    kernel = "the fp32 GEMM (core.cpu_gemm route)" if route == "fp32" else "torch's own kernel"
    return PeakFlops(cpu_peak_flops(dtype), f"measured {dtype} matmul on {kernel}", route)


def device_info() -> dict:
    if torch.cuda.is_available():
        name = torch.cuda.get_device_name()
        peak = cuda_peak_flops(name)
        source = (
            f"vendor bf16 dense ({gpu_model(name)})"
            if peak
            else f"no peak known for {name!r} (core/metrics.py PEAK_FLOPS): no MFU without metrics.peak_flops"
        )
        return {"device": name, "peak_flops": peak, "peak_source": source}
    return {
        "device": f"cpu ({cpu_model()}, {os.cpu_count()} cores)",
        "peak_flops": None,
        "peak_source": "measured bf16 matmul",
    }


def cpu_model() -> str:
    """The CPU's model name and its widest matmul ISA (AMX, AVX-512 with or without bf16, AVX2):
    bf16 matmul speed differs tens of times between them, so a CPU figure names its CPU."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    name = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")), "")
    flags = set(next((line.split(":", 1)[1].split() for line in info.splitlines() if line.startswith("flags")), []))
    if "amx_bf16" in flags:
        isa = "AMX"
    elif "avx512f" in flags:
        isa = f"AVX-512{' bf16' if 'avx512_bf16' in flags else ''}, no AMX"
    else:
        isa = f"{'AVX2' if 'avx2' in flags else 'no AVX2'}, no AVX-512, no AMX"
    return f"{name or platform.machine()}, {isa}"


def peak_memory_gib() -> float:
    """CUDA: max reserved (what the paper reports). CPU: this process's peak RSS."""
    if torch.cuda.is_available():
        return torch.cuda.max_memory_reserved() / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 2**30


def reset_peak_memory() -> None:
    """CUDA: start a new peak, the allocator's cache released first: reserved memory counts cached
    blocks, so without it the new peak could never fall below what step 1 reserved (compile
    workspaces, the pipeline's shape inference). CPU: nothing (peak RSS cannot be reset)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


class PeakMemory:
    """The first step's peak (lazy init, compilation, the pipeline's shape inference on empty
    inputs) apart from the steady peak: `first_step_done()` after step 1 records it and resets."""

    def __init__(self):
        self.first_step: float | None = None

    def first_step_done(self) -> float:
        self.first_step = peak_memory_gib()
        reset_peak_memory()
        return self.first_step

    @staticmethod
    def steady() -> float:
        return peak_memory_gib()


class MetricsLogger:
    """Per-step records to stdout (rank 0), a JSONL file and TensorBoard when installed."""

    def __init__(self, out_dir: Path, rank: int, enable_tensorboard: bool = False):
        self.rank = rank
        self.jsonl = None
        self.tb = None
        if rank == 0:
            out_dir.mkdir(parents=True, exist_ok=True)
            self.jsonl = open(out_dir / "metrics.jsonl", "a")  # noqa: SIM115 -- open for the run, closed by close()
            if enable_tensorboard:
                try:
                    from torch.utils.tensorboard import SummaryWriter  # local: optional dependency

                    self.tb = SummaryWriter(str(out_dir / "tb"))
                except ImportError:
                    log.warning("[metrics] tensorboard is not installed: logging to JSONL only")

    def log(self, step: int, values: dict) -> None:
        if self.rank != 0:
            return
        self.jsonl.write(json.dumps({"step": step, **values}) + "\n")
        self.jsonl.flush()
        if self.tb:
            for k, v in values.items():
                if isinstance(v, (int, float)):
                    self.tb.add_scalar(k, v, step)

    def close(self) -> None:
        if self.jsonl:
            self.jsonl.close()
        if self.tb:
            self.tb.close()


def trim_metrics(path: Path, last_step: int) -> None:
    """metrics.jsonl keeps the steps up to `last_step` (a resumed run writes the later ones
    again): the lines of later steps move to metrics.replaced.jsonl (nothing is lost), atomically."""
    if not path.is_file():
        return
    keep, moved = [], []
    for line in path.read_text().splitlines():
        try:
            (keep if json.loads(line).get("step", 0) <= last_step else moved).append(line)
        except (json.JSONDecodeError, AttributeError):
            moved.append(line)  # a torn last line of a killed run
    if not moved:
        return
    with open(path.with_name("metrics.replaced.jsonl"), "a") as f:
        f.write("".join(m + "\n" for m in moved))
    atomic_write(path, "".join(k + "\n" for k in keep))


def progress_bar_wanted(cfg) -> bool:
    """A progress bar only where a person watches a terminal (the launcher's, when there is one):
    in a file or a pipe its redraws are one endless line."""
    if not cfg.metrics.progress:
        return False
    said = os.environ.get(PROGRESS_TTY_ENV)
    return said == "1" if said is not None else sys.stderr.isatty()


class StepLog:
    """The training loop's per-step metrics, every metrics.log_freq steps and at the last: a line
    on rank 0's stdout (train.log has one per logged step) and metrics.jsonl; rank 0's progress
    bar (metrics.progress) on a terminal only."""

    def __init__(
        self,
        out_dir: Path,
        rank: int,
        cfg,
        tokens_per_device: float,
        flops_per_token: float,
        peak_flops: float | None,
        first_step: int,
        peak_is_cpu: bool = False,
    ):
        self.cfg, self.tokens_per_device, self.rank = cfg, tokens_per_device, rank
        self.peak_is_cpu, self.peak_forgotten = peak_is_cpu, False  # a cached CPU peak a step may beat
        self.flops_per_token, self.peak_flops = flops_per_token, peak_flops
        self.logger = MetricsLogger(out_dir, rank, cfg.metrics.enable_tensorboard)
        self.bar = None
        if rank == 0 and progress_bar_wanted(cfg):
            self.bar = tqdm(
                total=cfg.training.steps,
                initial=first_step,
                desc=cfg.job.name,
                unit="step",
                file=sys.stderr,
                dynamic_ncols=True,
            )

    def log(self, step: int, loss: float, grad_norm: float, lr: float, dt: float, data_dt: float) -> None:
        """One step's line; `lr`: the rate its update used (read before the scheduler steps)."""
        tps = self.tokens_per_device / dt
        if step % self.cfg.metrics.log_freq == 0 or step == self.cfg.training.steps:
            values = {
                "loss": loss,
                "grad_norm": grad_norm,
                "lr": lr,
                "step_time_s": dt,
                "data_time_s": data_dt,
                "tokens_per_sec_per_device": tps,
                "mfu": self.flops_per_token * tps / self.peak_flops if self.peak_flops else None,
                "memory_gib": peak_memory_gib(),
            }
            if values["mfu"] and values["mfu"] > 1 and self.peak_is_cpu and not self.peak_forgotten:
                forget_cpu_peak()  # the record's check refuses it; the next launch re-measures
                self.peak_forgotten = True
            self.logger.log(step, values)
            if self.rank == 0:
                self.write(step_line(step, self.cfg.training.steps, values))
        if self.bar:
            self.bar.set_postfix(loss=f"{loss:.4f}", tps=f"{tps:,.0f}")
            self.bar.update(1)

    def write(self, line: str) -> None:
        """A line that does not break the progress bar."""
        if self.bar:
            self.bar.write(line, file=sys.stdout)
        else:
            log.info(line)

    def close(self) -> None:
        if self.bar:
            self.bar.close()
        self.logger.close()


def step_line(step: int, steps: int, v: dict) -> str:
    """One logged step as a person reads it (the same figures as metrics.jsonl)."""
    mfu = f"  mfu {v['mfu']:.1%}" if v.get("mfu") is not None else ""
    return (
        f"step {step}/{steps}  loss {v['loss']:.4f}  grad_norm {v['grad_norm']:.3f}  lr {v['lr']:.3g}  "
        f"{v['tokens_per_sec_per_device']:,.0f} tokens/s/device{mfu}  mem {v['memory_gib']:.2f} GiB  "
        f"step {v['step_time_s']:.3f} s"
    )
