"""Regional compile: `torch.compile` each transformer block (fullgraph), not the whole model.

Every block runs the same code on same-shaped tensors, and dynamo lifts module parameters to
graph inputs, so the first block's compiled graph is reused by all the others: the cold
compile costs about one block, not the whole model. The embedding, final norm, output, the
pipeline / FSDP2 / TP hooks around each block stay eager, which is what lets compile compose
with them (and with activation checkpointing, applied before: the checkpoint wrapper is
compiled with the block).

Compiled artifacts (inductor's FX graph cache, AOTAutograd cache, generated C++/Triton code)
go to TORCHINDUCTOR_CACHE_DIR; unless the caller set it we use `.cache/inductor` under the
repo, so a rerun of any job on this machine skips the cold compile. With `compile.shared_cache`
on (auto: on CPU) the ranks of a job also share one compile of each graph
(core/toggles/compile_cache.py); otherwise torch's own caching runs, unpatched. A cache file that
does not load (a damaged wrapper, kernel library or ISA probe) is named, moved aside and built again
(`survive_damaged_cache`, docs/compile-cache.md).
"""

from __future__ import annotations

import contextlib
import logging
import os
import platform
import re
import shlex
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.nn as nn
from torch.distributed._functional_collectives import AsyncCollectiveTensor  # private: no public type of it
from torch.distributed.tensor import DTensor

from core.config import Compile
from core.fileio import move_aside
from core.toggles import compile_cache
from core.toggles.group_roles import name_groups

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_CACHE_DIR = REPO_ROOT / ".cache" / "inductor"
log = logging.getLogger(__name__)


def ensure_cache_dir() -> str:
    """Point inductor's caches at the project cache dir unless TORCHINDUCTOR_CACHE_DIR is set."""
    # Imported here: inductor's config costs ~1 s to import and only compile runs need it. Private
    # modules: the caches' switches and torch's default cache dir have no public API.
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    path = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if path is None or path == default_cache_dir():  # unset, or set by torch's own first lookup
        path = os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(DEFAULT_CACHE_DIR)
    os.makedirs(path, exist_ok=True)
    # Both are on by default in recent torch; set them so an older default cannot disable reuse.
    inductor_config.fx_graph_cache = True
    functorch_config.enable_autograd_cache = True
    return path


_isa_probes_started = False
# The smallest kernel inductor's C++ cache builds as it builds a generated one (same header, flags).
TRIVIAL_KERNEL = '#include <torch/csrc/inductor/cpp_prefix.h>\nextern "C" void kernel(float* out) { out[0] = 0.0f; }\n'


def _start_isa_probes() -> list[threading.Thread]:
    """Inductor picks the CPU's vector ISA at the first compile by building a probe per candidate
    (AVX2, AVX512 and its bf16/VNNI variants), one after another: six g++ runs over ATen's vector
    headers, 8 s before the first kernel builds on a cold cache (this EPYC). Each runs here in its
    own daemon thread (g++ runs outside the GIL); inductor then reads the cached answers, or waits
    on the same file lock for one still building."""
    global _isa_probes_started
    if _isa_probes_started or platform.machine() not in ("x86_64", "AMD64"):
        return []
    _isa_probes_started = True
    from torch._inductor import cpu_vec_isa  # private: inductor's ISA probes (no public way to start them)

    flags = cpu_vec_isa.x86_isa_checker()
    probes = []
    for isa in cpu_vec_isa.supported_vec_isa_list:  # inductor's own filter (valid_vec_isa_list)
        if all(flag in flags for flag in str(isa).split()):
            _set_aside_a_damaged_probe(isa)  # here, not in the thread: before inductor may ask for it
            probes.append(threading.Thread(target=bool, args=(isa,), name=f"isa-probe-{isa}", daemon=True))
            probes[-1].start()
    return probes


def _set_aside_a_damaged_probe(isa) -> None:
    """A probe's library in the cache that is no library (0 bytes, random bytes) fails its dlopen
    check: inductor then takes the CPU to lack that ISA and emits vector code it cannot build
    (torch 2.13: "'at::vec' has not been declared", every compile). Moved aside, it is built again.
    Checked under the probe's own lock, as inductor builds it."""
    # private: the probe's source, fingerprint, cache file and lock (no public way to name them)
    from torch._inductor import codecache, cpu_vec_isa
    from torch.utils._filelock import FileLock

    try:
        extra = cpu_vec_isa._get_isa_dry_compile_fingerprint(isa.build_arch_flags())
        key, cpp = codecache.write(cpu_vec_isa.VecISA._avx_code, "cpp", extra=extra)
    except (AttributeError, TypeError):  # another torch: its probes as they are
        return
    lib = Path(cpp).with_suffix(".so")
    lock = FileLock(os.path.join(codecache.get_lock_dir(), key + ".lock"), timeout=codecache.LOCK_TIMEOUT)
    with lock, contextlib.suppress(OSError), open(lib, "rb") as f:
        if f.read(4) != b"\x7fELF":
            log.warning("warning: %s", set_aside(Damage(lib, "not a shared library")))


def probe_cpu_isas_in_background() -> None:
    """The ISA probes (_start_isa_probes), overlapping the tracing of the first graph."""
    if not torch.cuda.is_available():
        _start_isa_probes()


def warm_before_fork() -> None:
    """What each rank's first compile computes the same way, computed once in the process the
    ranks are forked from (recipes/forked_run.py), so that every rank inherits it: inductor's hash
    of torch's sources, the CPU's vector ISA (probe builds and a dlopen check of each), the
    compiler's version checks and the precompiled header's hash. The last two by building one
    trivial kernel through inductor's own C++ cache. No CUDA call: the fork must not follow one."""
    from torch._inductor import codecache  # private: inductor's per-process caches, no public warm-up

    ensure_cache_dir()
    codecache.torch_key()
    for probe in _start_isa_probes():
        probe.join()  # no thread may be alive at the fork
    survive_damaged_cache()
    try:
        codecache.CppPythonBindingsCodeCache.load_pybinding(["float*"], TRIVIAL_KERNEL)
    except Exception as e:
        if (damaged := damaged_cache_file(e)) is None:
            raise
        log.warning("warning: %s", set_aside(damaged))
        codecache.CppPythonBindingsCodeCache.load_pybinding(["float*"], TRIVIAL_KERNEL)  # built again


# ---------------------------------------------------------------------- a damaged cache file
# One damaged file in inductor's cache (a wrapper of random bytes, a 0-byte kernel library) broke
# every later compiled run, naming neither the cache nor the remedy: inductor reuses a file that is
# there. A file that does not load is moved aside, so that inductor writes or builds it again.
_DAMAGED = re.compile(r"Failed to import (\S+\.py)$|\b(ImportError|OSError): (\S+\.so): ", re.MULTILINE)
DAMAGED_SUFFIX = ".damaged"


class Damage(NamedTuple):
    path: Path  # a file of inductor's cache
    why: str  # what loading it said


def damaged_cache_file(e: BaseException) -> Damage | None:
    """The file of inductor's cache that `e` (or the exception it came from) failed to load: a
    wrapper that does not import, a kernel library that does not load; None if it names none."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir  # private: inductor's cache dir, resolved

    root, seen, x = Path(cache_dir()).resolve(), set(), e
    while x is not None and id(x) not in seen:
        seen.add(id(x))
        text = f"{type(x).__name__}: {x}"
        for m in _DAMAGED.finditer(text):
            path = Path(m.group(1) or m.group(3))
            there = path.is_file() or path.with_name(path.name + DAMAGED_SUFFIX).is_file()  # or moved already
            if there and path.resolve().is_relative_to(root):
                after = text[m.end() :].lstrip("\n").splitlines()  # a library: the rest of its line
                said = (after[0] if after else "").strip()  # a wrapper: the line after "Failed to import"
                return Damage(path, (f"{m.group(2)}: {said}" if m.group(2) else said)[:200] or type(x).__name__)
        x = x.__cause__ or x.__context__
    return None


def set_aside(damage: Damage) -> str:
    """Move a damaged cache file aside (`<name>.damaged`); the line that says so and the remedy."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir  # private: inductor's cache dir, resolved

    path = damage.path
    aside = move_aside(path, DAMAGED_SUFFIX)  # another rank may have moved it first
    return (
        f"compile cache damaged: {path} does not load ({damage.why}); moved aside to {aside.name}, "
        f"so that it is built again (to clear the whole cache: rm -rf {shlex.quote(cache_dir())})"
    )


def damage_said(e: BaseException) -> str | None:
    """For a failure a damaged cache file caused: that file moved aside, and the line saying so."""
    damaged = damaged_cache_file(e)
    return None if damaged is None else set_aside(damaged)


def _loading_past_damage(raw: classmethod, cls, key: str, path: str, *args, **kwargs):
    """PyCodeCache.load_by_key_path (a compiled graph's wrapper module, and with it its kernels):
    a kernel library that does not load is moved aside and the wrapper loaded again (inductor
    builds the kernel anew); a wrapper that does not import is moved aside and the load fails
    with an OSError, which inductor's cache takes for a miss (it compiles the graph again)."""
    moved: set[Path] = set()
    while True:  # each round moves one file aside, once: a file built again that fails is an error
        try:
            return raw.__func__(cls, key, path, *args, **kwargs)
        except Exception as e:
            damaged = damaged_cache_file(e)
            if damaged is None or damaged.path in moved:
                raise
            moved.add(damaged.path)
            log.warning("warning: %s", set_aside(damaged))
            if damaged.path == Path(path):
                raise OSError(f"{path}: a damaged cached wrapper, moved aside") from e


def survive_damaged_cache() -> None:
    """Install _loading_past_damage (idempotent; torch 2.13's PyCodeCache, else nothing)."""
    from torch._inductor.codecache import PyCodeCache  # private: where inductor loads a cached wrapper

    raw = vars(PyCodeCache).get("load_by_key_path")
    if isinstance(raw, classmethod) and not getattr(raw.__func__, "_titan_survives_damage", False):

        def load_by_key_path(cls, key, path, *args, **kwargs):
            return _loading_past_damage(raw, cls, key, path, *args, **kwargs)

        load_by_key_path._titan_survives_damage = True
        PyCodeCache.load_by_key_path = classmethod(load_by_key_path)


def _materialize_async_input(module: nn.Module, args: tuple, kwargs: dict):
    """Forward pre-hook: a compiled block must not receive an AsyncCollectiveTensor.

    With TP, the embedding's RowwiseParallel reduce-scatters asynchronously and `to_local()`
    hands the first block a view that is an AsyncCollectiveTensor. AOTAutograd (torch 2.13)
    mis-wires such an input's autograd edge: the gradient bypasses to_local's backward (TP 2:
    "'Tensor' object has no attribute '_local_tensor'"; FSDP 2 x TP 2: silently wrong, 1.1e-2 off
    the reference in 10 steps; 1.9e-6 with this hook). Eager is fine. `clone()` waits for the
    collective and keeps the edge (`.wait()` would drop the grad_fn); cost: one activation copy
    per step. Later blocks get `h + ...`, a plain tensor.
    """
    if args and isinstance(args[0], AsyncCollectiveTensor):
        return (args[0].clone(),) + tuple(args[1:]), kwargs
    return None


def _holds_dtensors(module: nn.Module) -> bool:
    return any(isinstance(p, DTensor) for p in module.parameters())


def compile_block(block: nn.Module, cfg: Compile) -> nn.Module:
    """The block compiled (fullgraph): normally the whole block, activation checkpointing included.

    Exception, full AC on a tensor-parallel block: torch 2.13's AOTAutograd then saves the
    DeviceMesh (a graph input of the DTensor redistributes that backward recomputes) among the
    tensors for backward and fails ("expected all tensors_saved_with_vc_check to be Tensors").
    There the checkpoint stays eager around the compiled block: the same recompute-everything
    semantics (the compiled forward's saved tensors go through checkpoint's pack hooks; debug
    proxy: 57 MB saved for backward, as eager full AC, vs 460 MB compiled without AC), losses
    identical. Op-level SAC with TP compiles fine and stays inside.
    """
    if getattr(block, "ac_mode", None) == "full" and _holds_dtensors(block):
        # private attribute: the wrapper's inner module (no public accessor)
        inner = torch.compile(block._checkpoint_wrapped_module, backend=cfg.backend, fullgraph=cfg.fullgraph)
        block._checkpoint_wrapped_module = inner
        outer = block
    else:
        outer = torch.compile(block, backend=cfg.backend, fullgraph=cfg.fullgraph)
    outer.register_forward_pre_hook(_materialize_async_input, with_kwargs=True)
    return outer


def apply_compile(
    model: nn.Module,
    cfg: Compile,
    toggles,
    device_type: str,
    group_roles: dict[str, str] | None = None,
    precision_casts: bool = False,
    meshes: Callable[[tuple[str, ...]], Any] | None = None,
) -> nn.Module:
    """Replace each block of model.layers by its compiled version, in place. Returns model.

    `device_type` (the mesh's) resolves `cfg.shared_cache`; `group_roles` (mesh dim -> this
    rank's group name) and `meshes` (this job's mesh of some dim names) let ranks of different
    TP/CP groups share one compiled graph (core/toggles/group_roles.py). Inductor's
    `emulate_precision_casts` is on when `cfg.emulate_precision_casts` or `precision_casts`
    (rowwise Float8: core/toggles/float8.py wants_precision_casts) asks for it, and recorded as
    compile:emulate_precision_casts.

    FQNs gain `_orig_mod.`; torch.distributed.checkpoint's state_dict helpers strip it, so a
    checkpoint saved compiled loads uncompiled and back.
    """
    layers = getattr(model, "layers", None)
    blocks = [(n, b) for n, b in layers.named_children() if b is not None] if layers is not None else []
    if not blocks:
        toggles.skip("compile", "this pipeline stage holds no transformer blocks")
        return model
    ensure_cache_dir()
    survive_damaged_cache()
    compile_cache.use(compile_cache.wanted(cfg.shared_cache, device_type))
    probe_cpu_isas_in_background()
    name_groups(group_roles or {}, meshes)
    if cfg.emulate_precision_casts or precision_casts:
        import torch._inductor.config as inductor_config  # ~1 s import: compile runs only; no public switch

        inductor_config.emulate_precision_casts = True
    for name, block in blocks:
        layers.register_module(name, compile_block(block, cfg))
    toggles.apply("compile")
    if cfg.emulate_precision_casts or precision_casts:
        toggles.apply("compile:emulate_precision_casts")
    return model
