"""The modules a job imports only when it needs them, by feature, for a launcher that forks the
ranks (recipes/forked_run.py): imported once before the fork, every rank inherits them instead
of importing them at once with the others (16 ranks on 2 cores: 20 of the 23 s of trainer set-up)."""

from __future__ import annotations

import importlib

from core.config import JobConfig
from core.noise import quiet_library_warnings

# Not HF `datasets` (0.6 s): its pyarrow starts an allocator thread at import, and a process with
# threads is not safe to fork.
BY_FEATURE = {
    "float8": ("torchao.float8", "torch._inductor.codegen.triton"),  # torchao patches inductor's codegen
    "compile": ("torch._inductor.compile_fx", "torch._inductor.codegen.cpp", "torch._functorch.aot_autograd"),
}


def features(cfg: JobConfig) -> set[str]:
    return {name for name, used in (("float8", cfg.float8.enabled), ("compile", cfg.compile.enabled)) if used}


def import_for(cfgs: list[JobConfig]) -> list[str]:
    """Import what these jobs will import lazily; returns the module names. The known library
    messages (core/noise.py) are filtered first: torchao logs its own at import."""
    quiet_library_warnings()
    names = [m for f in sorted(set().union(*map(features, cfgs))) for m in BY_FEATURE[f]]
    for name in names:
        importlib.import_module(name)
    return names
