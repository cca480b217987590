"""The modules a job imports only when it needs them, by feature, for a launcher that forks the
ranks (recipes/forked_run.py): imported once before the fork, every rank inherits them instead
of importing them at once with the others (16 ranks on 2 cores: 20 of the 23 s of trainer set-up)."""

from __future__ import annotations

import contextlib
import importlib
import os

from core.config import JobConfig
from core.noise import quiet_library_warnings

BY_FEATURE = {
    "float8": ("torchao.float8", "torch._inductor.codegen.triton"),  # torchao patches inductor's codegen
    "compile": ("torch._inductor.compile_fx", "torch._inductor.codegen.cpp", "torch._functorch.aot_autograd"),
    "hf_datasets": ("datasets",),  # 0.7 s of CPU per rank (C4 and its offline corpus)
}
# pyarrow's jemalloc starts a background thread when the library loads, and a process with
# threads is not safe to fork: its purging thread is off (the ranks allocate through it all the same).
FORK_SAFE_ENV = {"JE_ARROW_MALLOC_CONF": "background_thread:false"}


def features(cfg: JobConfig) -> set[str]:
    used = {"float8": cfg.float8.enabled, "compile": cfg.compile.enabled}
    used["hf_datasets"] = cfg.data.dataset in ("c4", "c4_offline")
    return {name for name, on in used.items() if on}


def import_for(cfgs: list[JobConfig]) -> list[str]:
    """Import what these jobs will import lazily; returns the module names. The known library
    messages (core/noise.py) are filtered first: torchao logs its own at import."""
    quiet_library_warnings()
    for var, value in FORK_SAFE_ENV.items():
        os.environ.setdefault(var, value)
    names = [m for f in sorted(set().union(*map(features, cfgs))) for m in BY_FEATURE[f]]
    for name in names:
        importlib.import_module(name)
    return names


def prepare_for_fork(cfgs: list[JobConfig]) -> list[str]:
    """What a launcher that forks the ranks does first (recipes/forked_run.py): import_for, and for
    compiled jobs what every rank's first compile would compute alike (core/toggles/compile.py)."""
    names = import_for(cfgs)
    _measure_cpu_peaks(cfgs)
    if any(cfg.compile.enabled for cfg in cfgs):
        from core.toggles.compile import warm_before_fork

        # only a head start: a failure here (no compiler, say) is met again by each rank's own
        # compile, which reports it as a rank's failure
        with contextlib.suppress(Exception):
            warm_before_fork()
    return names


def _measure_cpu_peaks(cfgs: list[JobConfig]) -> None:
    """The CPU peak each job's MFU is measured against (core.metrics.cpu_peak), measured here, in
    the one process, with the GEMM route the ranks will run: the forked ranks find it cached,
    rather than each measuring it while the others share the cores."""
    import torch

    from core import cpu_gemm
    from core.metrics import cpu_peak

    if torch.cuda.is_available():
        return
    before = cpu_gemm.active()
    try:
        for cfg in cfgs:
            if cfg.metrics.peak_flops:
                continue
            dtype = cfg.training.mixed_precision_param
            cpu_gemm.use(cpu_gemm.resolve(cfg.training.bf16_gemm, torch.device("cpu"), dtype))
            cpu_peak(dtype if dtype == "bfloat16" else "float32")
    finally:
        cpu_gemm.use(before)
