"""Ranks of a job share inductor's FX-graph cache (torch 2.13; opt-in: compile.shared_cache).

Every rank compiles the same transformer block, so one compile could serve them all. Three things
in torch 2.13 stop that:

1. The cache key of a DTensor graph changes from process to process. Its DeviceMesh inputs are
   pickled whole (this rank, its thread id, its groups) and switch the key's pickler into memo
   mode, so the bytes differ on every rank and in every run: each rank of each run misses.
   Here a mesh is keyed by what compiled code can depend on: device type, dim names, shape.
   Whatever a graph bakes in from the real mesh (coordinates, group names) is in its code, which
   the key hashes anyway.
2. A TP or CP graph names its process group in its code ('27' on ranks 0-1, '28' on ranks 2-3),
   so ranks of different groups compile one program apart from that name; its AOTAutograd entry
   pickles the DeviceMesh of its DTensors whole (rank, coordinates, group names). Groups and
   meshes registered by role (core/toggles/group_roles.py) are written as their role in both keys,
   in the saved code and in the saved entry; a rank that loads them gets its own groups and mesh
   back (the 16-rank 4D row compiles 4 distinct graphs instead of 32, and traces them 4 times
   instead of 16). Without a registered job mesh the AOTAutograd key keeps the raw group names.
3. The ranks compile at the same moment, so all of them miss. A file lock per key lets the first
   rank compile and save while the others wait for it, then load its graph (single flight): per
   AOTAutograd entry (the whole trace and compile of a block, its backward lowered at once rather
   than at the first backward, so the lock is never held across a collective) and per FX graph.
4. A graph that calls an autograd.Function marked allow_in_graph (torchao's Float8 casts and
   matmul) holds it through a closure Dynamo makes per call, which the AOTAutograd key cannot
   name: every rank of every run bypasses that cache and re-traces the joint graph (6 s of a
   warm 8 s first step, world 2). Here the key names the class, its package's version and a hash
   of its module's source, so an upgrade or an edit misses. The plain-data classes the same
   graphs construct (torchao's ScaledMMConfig) are marked cacheable, keyed by torchao's version,
   through inductor's own `unsafe_marked_cacheable_functions`.

This patches torch internals, so it installs only where the functions are the ones written for,
and only where it was proven: `compile.shared_cache` (auto: CPU ranks on gloo, torch 2.13; CUDA
runs keep torch's own caching unless set on). `use()` installs or removes it for each job.
No library provides it. A lock is held only while this process compiles, never across a
collective. A compile that fails releases it. A rank that has waited WAIT_S compiles itself.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import logging
import os
import pickle
import sys
import threading
from collections.abc import Callable
from typing import Any

import filelock

from core.toggles.group_roles import (
    GROUP_TOKEN,
    canonical_code,
    job_mesh,
    local_code,
    names_unregistered_groups,
    registered,
    roles_of,
)
from core.versions import installed_version

log = logging.getLogger(__name__)

WAIT_S = 900.0  # longest wait for another rank's compile of the same graph (16 ranks on 2 cores: ~2 min)
# .held / .aot_held: key -> lock, for the compile running on this thread; .entry_by_role: its
# AOTAutograd entry may be saved by role
_state = threading.local()
CACHES = {"fxgraph": ("inductor", "fxgraph_cache_"), "aot_autograd": ("aot_autograd", "autograd_cache_")}


def counts(cache: str = "fxgraph") -> dict[str, int]:
    """This process's lookups so far in one of CACHES (torch's counters): hit, miss, bypass."""
    from torch._dynamo.utils import counters  # private: torch's cache counters have no public reader

    group, prefix = CACHES[cache]
    return {k: counters[group][f"{prefix}{k}"] for k in ("hit", "miss", "bypass")}


def all_counts() -> dict[str, dict[str, int]]:
    return {cache: counts(cache) for cache in CACHES}


def counts_of_all_ranks(since: dict[str, dict[str, int]]) -> dict[str, dict[str, int]]:
    """Lookups per cache since `since` (an all_counts()), summed over the ranks (collective: every
    rank calls it)."""
    import torch.distributed as dist

    mine = {c: {k: v - since[c][k] for k, v in now.items()} for c, now in all_counts().items()}
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return {c: {k: sum(r[c][k] for r in every) for k in mine[c]} for c in mine}


def cache_key_part(*parts):
    """What an object contributes to a cache key (pickled by reference with its parts)."""
    return parts


def _mesh_reduce(mesh, with_groups: bool = False):
    """A DeviceMesh in a key: (device type, dim names, shape), plus in an AOTAutograd key this
    rank's coordinate and its groups' roles, or their names where they have none: that entry's
    graphs can depend on both (a DTensor all_to_all's split sizes follow the coordinate)."""
    groups: tuple = ()
    if with_groups:
        # private: a mesh's group names, without creating groups (no public accessor)
        names = tuple(getattr(mesh, "_dim_group_names", ()))
        roles = roles_of(names)
        groups = (names if roles is None else (GROUP_TOKEN, *roles), tuple(mesh.get_coordinate() or ()))
    return cache_key_part, (mesh.device_type, mesh.mesh_dim_names, tuple(mesh.mesh.shape), groups)


def _lock_path(key: str) -> str:
    from torch._inductor.runtime.cache_dir_utils import cache_dir  # private: inductor's cache dir, resolved

    folder = os.path.join(cache_dir(), "titan_fxgraph_locks")
    os.makedirs(folder, exist_ok=True)
    return os.path.join(folder, f"{key}.lock")


def _acquire(key: str) -> filelock.FileLock | None:
    """The lock of `key`, held; None after WAIT_S (this rank then compiles alone)."""
    lock = filelock.FileLock(_lock_path(key))
    try:
        lock.acquire(timeout=WAIT_S)
    except filelock.Timeout:
        log.warning("compile cache: waited %.0f s for another rank's compile; compiling here", WAIT_S)
        return None
    return lock


# --------------------------------------------------------------------------- the patches
# Each replaces one private torch function (kept in _torch while installed) and calls it.


def _aot_pickler() -> type:
    """AOTAutograd's key pickler, a subclass of inductor's: its keys name the mesh's groups."""
    # private module: AOTAutograd's cache (no public API to its keys)
    from torch._functorch._aot_autograd.autograd_cache import AOTAutogradCachePickler

    return AOTAutogradCachePickler


def _reduce_script_object_stably(self, t):
    from torch.distributed.device_mesh import DeviceMesh

    if isinstance(t.real_obj, DeviceMesh):  # instead of pickling the mesh whole (and in memo mode)
        return _mesh_reduce(t.real_obj, isinstance(self, _aot_pickler()))
    return _torch["reduce_script_object"](self, t)


def _init_with_mesh(self, gm, *args, **kwargs):
    from torch.distributed.device_mesh import DeviceMesh

    _torch["pickler_init"](self, gm, *args, **kwargs)
    aot = isinstance(self, _aot_pickler())
    self.dispatch_table[DeviceMesh] = functools.partial(_mesh_reduce, with_groups=aot)  # held by the module
    if not aot:  # torch registers its reducer (the code, cleaned) for graphs with Triton kernels only
        self.dispatch_table[type(gm)] = self._reduce_graph_module


def _reduce_graph_module_by_role(self, gm):
    fn, (data, imports) = _torch["reduce_graph_module"](self, gm)
    data["_code"] = canonical_code(data["_code"]) or data["_code"]
    return fn, (data, imports)


def _autograd_function_of(obj: Any) -> type | None:
    """The autograd.Function behind Dynamo's per-call trampoline to its apply, else None."""
    import torch
    from torch._dynamo.variables.misc import produce_trampoline_autograd_apply  # private: no public name

    if getattr(obj, "_origin", None) is not produce_trampoline_autograd_apply or not obj.__closure__:
        return None
    fn_cls = obj.__closure__[0].cell_contents
    return fn_cls if isinstance(fn_cls, type) and issubclass(fn_cls, torch.autograd.Function) else None


@functools.cache
def autograd_function_fingerprint(fn_cls: type) -> str:
    """What names an autograd.Function in a key: its path, its package's version, its module's source."""
    module = sys.modules[fn_cls.__module__]
    version = installed_version(fn_cls.__module__.split(".")[0]) or "?"
    try:
        source = hashlib.sha256(inspect.getsource(module).encode()).hexdigest()[:16]
    except (OSError, TypeError):  # no source file: the version alone
        source = "no-source"
    return f"{fn_cls.__module__}.{fn_cls.__qualname__} {version} {source}"


def _format_global_naming_functions(name: str, obj: Any) -> str:
    fn_cls = _autograd_function_of(obj)
    if fn_cls is not None:
        return f"# autograd.Function {name}: {autograd_function_fingerprint(fn_cls)}"
    return _torch["format_global"](name, obj)


# What AOTAutograd's check refuses in a Float8 graph, marked cacheable through inductor's own
# `unsafe_marked_cacheable_functions` (name -> a version string, which is part of the key): the
# plain data torchao's graphs construct (NamedTuples, frozen dataclasses: their arguments are in
# the graph, so in the key), keyed by torchao's version; and Dynamo's trampoline, which the key
# writes as the class it calls (_format_global_naming_functions), keyed by torch's version.
CACHEABLE = {
    "torchao.float8.float8_training_tensor.ScaledMMConfig": "torchao",
    "torchao.float8.float8_training_tensor.LinearMMConfig": "torchao",
    "torchao.float8.config.CastConfig": "torchao",
    "torchao.float8.config.Float8GemmConfig": "torchao",
    "torchao.float8.config.Float8LinearConfig": "torchao",
    "torch._dynamo.variables.misc.trampoline_autograd_apply": "torch",
}


def _mark_cacheable(on: bool) -> None:
    """Add (on) or remove inductor's cacheable marks of CACHEABLE."""
    import torch._inductor.config as inductor_config  # private: the marks have no public setter

    marks = inductor_config.unsafe_marked_cacheable_functions
    for name, package in CACHEABLE.items():
        if not on:
            marks.pop(name, None)
        elif (version := installed_version(package)) is not None:
            marks[name] = f"{package} {version}"


def _lower_backward_at_once(on: bool) -> None:
    """AOTAutograd lowers a backward at its first call by default, so its entry is saved then, after
    collectives: on, the whole entry is made inside the block's compile (under its lock)."""
    import torch._functorch.config as functorch_config  # public module, this flag has no other setter

    functorch_config.force_non_lazy_backward_lowering = on


def _single_flight(held: dict | None, key: str, lookup: Callable, missed: Callable[[Any], bool]):
    """`lookup(key)` under the key's lock; on a miss this rank keeps the lock in `held` (it compiles,
    the others wait until it saves). No lock outside a compile (`held` None) or when already held."""
    if held is None or key in held:
        return lookup(key)
    lock = _acquire(key)
    if lock is None:
        return lookup(key)
    try:
        found = lookup(key)
    except BaseException:
        lock.release()
        raise
    if missed(found):
        held[key] = lock
    else:
        lock.release()
    return found


def _release(held_attr: str, key: str) -> None:
    lock = (getattr(_state, held_attr, None) or {}).pop(key, None)
    if lock is not None:
        lock.release()


def _load_single_flight(key, *args, **kwargs):
    return _single_flight(
        getattr(_state, "held", None),  # None outside a compile (AOTAutograd's own lookups)
        key,
        lambda k: _torch["load_with_key"](k, *args, **kwargs),
        lambda found: found[0] is None and found[1].get("cache_state") == "miss",
    )


def _save_by_role_and_release(key, compiled_graph, *args, **kwargs):
    save_graph = _torch["save_graph"]
    raw = getattr(compiled_graph, "source_code", None)  # None: not a CompiledFxGraph (torch refuses it)
    try:
        if raw is None:
            return save_graph(key, compiled_graph, *args, **kwargs)
        saved = canonical_code(raw) if getattr(compiled_graph, "_original_gm", None) is None else None
        if saved is None:  # a group name outside an op call: the key may be by role, the code not
            log.warning("compile cache: graph %s names a group outside an op call; not saved", key)
            return None
        _not_by_role_if_unregistered(saved)
        compiled_graph.source_code = saved  # _save_graph pickles a copy of it
        return save_graph(key, compiled_graph, *args, **kwargs)
    finally:
        if raw is not None:
            compiled_graph.source_code = raw
        _release("held", key)


def _not_by_role_if_unregistered(code: str) -> None:
    """A graph that names a group without a role (its FX key names it too) keeps the AOTAutograd
    entry of this compile from being saved: that entry's key has roles, and would serve it to ranks
    of other groups."""
    if names_unregistered_groups(code):
        _state.entry_by_role = False


def _deserialize_with_own_groups(self, *args, **kwargs):
    if GROUP_TOKEN in self.source_code:
        self.source_code = local_code(self.source_code)
        # its own module file: ranks of other groups load the same key with other names
        self.cache_key += hashlib.sha256(self.source_code.encode()).hexdigest()[:16]
    _not_by_role_if_unregistered(self.source_code)
    return _torch["after_deserialization"](self, *args, **kwargs)


def _compile_fx_inner_tracking_locks(*args, **kwargs):
    outer, _state.held = getattr(_state, "held", None), {}
    try:
        return _torch["compile_fx_inner"](*args, **kwargs)
    finally:
        for lock in _state.held.values():  # a compile that failed never saved: let the others in
            lock.release()
        _state.held = outer


# ------------------------------------------------------------- AOTAutograd entries by role
def _compile_fx_tracking_aot_locks(*args, **kwargs):
    """One block's compile (Dynamo's backend): an AOTAutograd lock it took is let go by its end."""
    outer = getattr(_state, "aot_held", None)
    if outer is not None:  # inductor calls itself: the outermost call owns the locks
        return _torch["compile_fx"](*args, **kwargs)
    _state.aot_held, _state.entry_by_role = {}, True
    try:
        return _torch["compile_fx"](*args, **kwargs)
    finally:
        for lock in _state.aot_held.values():  # not saved (a failure, a bypass): let the others in
            lock.release()
        _state.aot_held = None


def _aot_lookup_single_flight(key, *args, **kwargs):
    lookup = _torch["aot_lookup"]
    return _single_flight(
        getattr(_state, "aot_held", None), key, lambda k: lookup(k, *args, **kwargs), lambda f: f is None
    )


def _aot_save_and_release(key, *args, **kwargs):
    try:
        return _torch["aot_save"](key, *args, **kwargs)
    finally:
        _release("aot_held", key)


class _EntryPickler(pickle.Pickler):
    """Pickles an AOTAutograd entry with each DeviceMesh as its dims, loaded as this job's mesh."""

    def reducer_override(self, obj):
        from torch.distributed.device_mesh import DeviceMesh

        if not isinstance(obj, DeviceMesh) or not registered():
            return NotImplemented
        if roles_of(tuple(getattr(obj, "_dim_group_names", ()))) is None:  # private, as in _mesh_reduce
            raise pickle.PicklingError("a mesh of groups without a role: its entry would carry this rank's")
        return job_mesh, (obj.device_type, tuple(obj.mesh_dim_names or ()), tuple(obj.mesh.shape))


def _pickle_entry_by_role(entry, remote):
    import io

    import torch

    if not registered():
        return _torch["aot_pickle_entry"](entry, remote)
    if not getattr(_state, "entry_by_role", True):
        log.info("compile cache: AOTAutograd entry not saved (its graphs name a group without a role)")
        return None
    buf = io.BytesIO()
    try:
        with torch.utils._python_dispatch._disable_current_modes():  # private: as torch pickles an entry
            _EntryPickler(buf).dump(entry)
    except (pickle.PicklingError, TypeError, AttributeError) as e:
        log.info("compile cache: AOTAutograd entry not saved (%s)", e)
        return None
    return buf.getvalue()


PATCHES = {  # key of a patched torch attribute (targets()) -> what replaces it
    "reduce_script_object": _reduce_script_object_stably,
    "reduce_graph_module": _reduce_graph_module_by_role,
    "pickler_init": _init_with_mesh,
    "load_with_key": _load_single_flight,
    "save_graph": _save_by_role_and_release,
    "after_deserialization": _deserialize_with_own_groups,
    "compile_fx_inner": _compile_fx_inner_tracking_locks,
    "format_global": _format_global_naming_functions,
    "compile_fx": _compile_fx_tracking_aot_locks,
    "aot_lookup": _aot_lookup_single_flight,
    "aot_save": _aot_save_and_release,
    "aot_pickle_entry": _pickle_entry_by_role,
}
_torch: dict[str, Callable] = {}  # key -> torch's function, while the patches are installed
_raw: dict[str, Any] = {}  # key -> the attribute as it was (a staticmethod stays one), to put back


def targets() -> dict[str, tuple[Any, str]]:
    """The private torch attributes the patches replace: key -> (owner, attribute name)."""
    # private modules: inductor's compile entry point, cache and compiled artifact (no public API)
    import torch._inductor.compile_fx as compile_fx
    from torch._functorch._aot_autograd.autograd_cache import AOTAutogradCache
    from torch._inductor.codecache import FxGraphCache, FxGraphCachePickler
    from torch._inductor.output_code import CompiledFxGraph

    return {
        # the key pickler's reducer for script objects: where a DeviceMesh is pickled whole
        "reduce_script_object": (FxGraphCachePickler, "_reduce_fake_script_object"),
        # its reducer of a GraphModule's code: where group names go into the key
        "reduce_graph_module": (FxGraphCachePickler, "_reduce_graph_module"),
        "pickler_init": (FxGraphCachePickler, "__init__"),  # where its dispatch table is filled
        "load_with_key": (FxGraphCache, "load_with_key"),  # one cache lookup: no public hook around it
        "save_graph": (FxGraphCache, "_save_graph"),  # one cache save: no public hook around it
        # saved code into a module: where this rank's group names go back in
        "after_deserialization": (CompiledFxGraph, "after_deserialization"),
        # one compile of one graph (lookup, compile, save): where a failed compile's locks are let go
        "compile_fx_inner": (compile_fx, "_compile_fx_inner"),
        # how the AOTAutograd key writes a global of a graph's code: where Float8's closures fail
        "format_global": (_aot_pickler(), "_format_global_for_cache_key"),
        # one block's compile, Dynamo's backend (resolved at each call): where AOTAutograd locks end
        "compile_fx": (compile_fx, "compile_fx"),
        # one AOTAutograd lookup, save, and pickling of an entry: no public hooks around them
        "aot_lookup": (AOTAutogradCache, "_lookup"),
        "aot_save": (AOTAutogradCache, "save"),
        "aot_pickle_entry": (AOTAutogradCache, "_pickle_entry"),
    }


def wanted(choice: str, device_type: str) -> bool:
    """compile.shared_cache resolved for a run on `device_type`: auto is on where the patches
    were proven (CPU ranks on gloo, torch 2.13), off elsewhere (CUDA: torch's own caching)."""
    if choice == "auto":
        return device_type == "cpu"
    return choice == "on"


def active() -> bool:
    """Whether the patches are installed in this process."""
    return bool(_torch)


def install() -> bool:
    """Patch the pickler of cache keys, the FX-graph cache and the loading of its code
    (idempotent). False if this torch does not have the internals the patches were written for
    (nothing is patched then)."""
    if _torch:
        return True
    _aot_pickler()
    found = targets()
    if not all(callable(getattr(owner, name, None)) for owner, name in found.values()):
        log.warning("compile cache: this torch lacks the FX-graph cache internals; ranks compile alone")
        return False
    for key, (owner, name) in found.items():
        _raw[key], _torch[key] = vars(owner)[name], getattr(owner, name)
    for key, (owner, name) in found.items():
        patch = _named_as(_torch[key], PATCHES[key]) if name == "__init__" else PATCHES[key]
        setattr(owner, name, staticmethod(patch) if isinstance(_raw[key], staticmethod) else patch)
    _mark_cacheable(True)
    _lower_backward_at_once(True)
    return True


def _named_as(original: Callable, patch: Callable) -> Callable:
    """`patch` under `original`'s name and signature (a class's __init__ keeps torch's)."""

    @functools.wraps(original)
    def patched(*args, **kwargs):
        return patch(*args, **kwargs)

    return patched


def uninstall() -> None:
    """Put torch's functions back (idempotent)."""
    for key, (owner, name) in targets().items():
        if key in _raw:
            setattr(owner, name, _raw[key])
    if _torch:
        _mark_cacheable(False)
        _lower_backward_at_once(False)
    _torch.clear()
    _raw.clear()


def use(on: bool) -> bool:
    """Install (on) or remove (off) the patches in this process; whether they are installed."""
    if on:
        return install()
    uninstall()
    return False
