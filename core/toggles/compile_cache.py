"""Ranks of a job share inductor's FX-graph cache (torch 2.13; installed by compile.ensure_cache_dir).

Every rank compiles the same transformer block, so one compile could serve them all. Three things
in torch 2.13 stop that:

1. The cache key of a DTensor graph changes from process to process. Its DeviceMesh inputs are
   pickled whole (this rank, its thread id, its groups) and switch the key's pickler into memo
   mode, so the bytes differ on every rank and in every run: each rank of each run misses.
   Here a mesh is keyed by what compiled code can depend on: device type, dim names, shape.
   Whatever a graph bakes in from the real mesh (coordinates, group names) is in its code, which
   the key hashes anyway.
2. A TP or CP graph names its process group in its code ('27' on ranks 0-1, '28' on ranks 2-3),
   so ranks of different groups compile one program apart from that name. Groups registered by
   role (`name_groups`: mesh dim -> this rank's group) are written as their role in the key and
   in the saved code, and a rank that loads the code puts its own group back (the 16-rank 4D row
   compiles 4 distinct graphs instead of 32). The AOTAutograd entry above an FX graph keeps a
   copy of the backward graph with the raw names, so its key has the mesh's group names: ranks of
   other groups never load it (that is what broke a warm TP 2 x DP 2 rerun: "Could not resolve
   the process group").
3. The ranks compile at the same moment, so all of them miss. A file lock per key lets the first
   rank compile and save while the others wait for it, then load its graph (single flight).

This patches torch internals, so it installs only where the functions are the ones written for.
No library provides it. A lock is held only while this process compiles, never across a
collective. A compile that fails releases it. A rank that has waited WAIT_S compiles itself.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import re
import threading

import filelock

log = logging.getLogger(__name__)

WAIT_S = 900.0  # longest wait for another rank's compile of the same graph (16 ranks on 2 cores: ~2 min)
_state = threading.local()  # .held: key -> lock, for the compile running on this thread
_installed = False
GROUP_TOKEN = "titan-group:"  # a role as written in keys and saved code: 'titan-group:tp'
_role_of_name: dict[str, str] = {}  # this process's group name -> role
_name_of_role: dict[str, str] = {}
_OP_LINE = re.compile(r"^.*torch\.ops\..*$", re.M)  # group names are arguments of c10d/symm_mem ops
_TOKEN = re.compile(r"'" + GROUP_TOKEN + r"(\w+)'")


def name_groups(roles: dict[str, str]) -> None:
    """This process's groups by role (mesh dim or flattened view -> group name), replacing any
    earlier job's. A group under two roles keeps the first: every rank registers in one order."""
    _role_of_name.clear()
    _name_of_role.clear()
    for role, name in roles.items():
        if name not in _role_of_name:
            _role_of_name[name] = role
            _name_of_role[role] = name


def canonical_code(code: str) -> str | None:
    """`code` with every registered group name in an op call written as its role; None if a
    registered name is left elsewhere (then nothing is shared: the code keeps its raw names)."""
    if not _role_of_name:
        return code

    def line(m: re.Match) -> str:
        text = m.group(0)
        for name, role in _role_of_name.items():
            text = text.replace(repr(name), repr(GROUP_TOKEN + role))
        return text

    out = _OP_LINE.sub(line, code)
    return None if any(repr(name) in out for name in _role_of_name) else out


def local_code(code: str) -> str:
    """Saved code with this process's group put back for each role."""

    def name(m: re.Match) -> str:
        if m.group(1) not in _name_of_role:
            raise RuntimeError(f"compiled code from the cache uses group role {m.group(1)!r}, not registered here")
        return repr(_name_of_role[m.group(1)])

    return _TOKEN.sub(name, code)


CACHES = {"fxgraph": ("inductor", "fxgraph_cache_"), "aot_autograd": ("aot_autograd", "autograd_cache_")}


def counts(cache: str = "fxgraph") -> dict[str, int]:
    """This process's lookups so far in one of CACHES (torch's counters): hit, miss, bypass."""
    from torch._dynamo.utils import counters

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
    """A DeviceMesh in a key: (device type, dim names, shape), plus its groups' names in an
    AOTAutograd key (that entry keeps a graph with the raw names, see the module doc)."""
    groups = tuple(getattr(mesh, "_dim_group_names", ())) if with_groups else ()
    return cache_key_part, (mesh.device_type, mesh.mesh_dim_names, tuple(mesh.mesh.shape), groups)


def _lock_path(key: str) -> str:
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    folder = os.path.join(cache_dir(), "titan_fxgraph_locks")
    os.makedirs(folder, exist_ok=True)
    return os.path.join(folder, f"{key}.lock")


def install() -> bool:
    """Patch the pickler of cache keys, the FX-graph cache and the loading of its code
    (idempotent). False if this torch does not have the internals the patches were written for
    (nothing is patched then)."""
    global _installed
    if _installed:
        return True
    import torch._inductor.compile_fx as compile_fx
    from torch._functorch._aot_autograd.autograd_cache import AOTAutogradCachePickler
    from torch._inductor.codecache import FxGraphCache, FxGraphCachePickler
    from torch._inductor.output_code import CompiledFxGraph
    from torch.distributed.device_mesh import DeviceMesh

    needed = (
        getattr(FxGraphCachePickler, "_reduce_fake_script_object", None),
        getattr(FxGraphCachePickler, "_reduce_graph_module", None),
        getattr(FxGraphCache, "load_with_key", None),
        getattr(FxGraphCache, "_save_graph", None),
        getattr(compile_fx, "_compile_fx_inner", None),
        getattr(CompiledFxGraph, "after_deserialization", None),
    )
    if not all(callable(f) for f in needed):
        log.warning("compile cache: this torch lacks the FX-graph cache internals; ranks compile alone")
        return False
    reduce_script_object, reduce_graph_module, load_with_key, save_graph, compile_fx_inner, deserialize = needed

    def reduce_script_object_stably(self, t):
        if isinstance(t.real_obj, DeviceMesh):  # instead of pickling the mesh whole (and in memo mode)
            return _mesh_reduce(t.real_obj, isinstance(self, AOTAutogradCachePickler))
        return reduce_script_object(self, t)

    init = FxGraphCachePickler.__init__

    @functools.wraps(init)
    def init_with_mesh(self, gm, *args, **kwargs):
        init(self, gm, *args, **kwargs)
        aot = isinstance(self, AOTAutogradCachePickler)
        self.dispatch_table[DeviceMesh] = functools.partial(_mesh_reduce, with_groups=aot)  # held by the module
        if not aot:  # torch registers its reducer (the code, cleaned) for graphs with Triton kernels only
            self.dispatch_table[type(gm)] = self._reduce_graph_module

    def reduce_graph_module_by_role(self, gm):
        fn, (data, imports) = reduce_graph_module(self, gm)
        data["_code"] = canonical_code(data["_code"]) or data["_code"]
        return fn, (data, imports)

    def load_single_flight(key, *args, **kwargs):
        held = getattr(_state, "held", None)
        if held is None or key in held:  # outside a compile (AOTAutograd's own lookups): no lock
            return load_with_key(key, *args, **kwargs)
        lock = filelock.FileLock(_lock_path(key))
        try:
            lock.acquire(timeout=WAIT_S)
        except filelock.Timeout:
            log.warning("compile cache: waited %.0f s for another rank's compile; compiling here", WAIT_S)
            return load_with_key(key, *args, **kwargs)
        try:
            graph, info = load_with_key(key, *args, **kwargs)
        except BaseException:
            lock.release()
            raise
        if graph is None and info.get("cache_state") == "miss":
            held[key] = lock  # this rank compiles it: the others wait until it is saved
        else:
            lock.release()
        return graph, info

    def release(key):
        lock = getattr(_state, "held", {}).pop(key, None)
        if lock is not None:
            lock.release()

    def save_by_role_and_release(key, compiled_graph, *args, **kwargs):
        raw = getattr(compiled_graph, "source_code", None)  # None: not a CompiledFxGraph (torch refuses it)
        try:
            if raw is None:
                return save_graph(key, compiled_graph, *args, **kwargs)
            saved = canonical_code(raw) if getattr(compiled_graph, "_original_gm", None) is None else None
            if saved is None:  # a group name outside an op call: the key may be by role, the code not
                log.warning("compile cache: graph %s names a group outside an op call; not saved", key)
                return None
            compiled_graph.source_code = saved  # _save_graph pickles a copy of it
            return save_graph(key, compiled_graph, *args, **kwargs)
        finally:
            if raw is not None:
                compiled_graph.source_code = raw
            release(key)

    def deserialize_with_own_groups(self, *args, **kwargs):
        if GROUP_TOKEN in self.source_code:
            self.source_code = local_code(self.source_code)
            # its own module file: ranks of other groups load the same key with other names
            self.cache_key += hashlib.sha256(self.source_code.encode()).hexdigest()[:16]
        return deserialize(self, *args, **kwargs)

    def compile_fx_inner_tracking_locks(*args, **kwargs):
        outer, _state.held = getattr(_state, "held", None), {}
        try:
            return compile_fx_inner(*args, **kwargs)
        finally:
            for lock in _state.held.values():  # a compile that failed never saved: let the others in
                lock.release()
            _state.held = outer

    FxGraphCachePickler._reduce_fake_script_object = reduce_script_object_stably
    FxGraphCachePickler._reduce_graph_module = reduce_graph_module_by_role
    FxGraphCachePickler.__init__ = init_with_mesh
    FxGraphCache.load_with_key = staticmethod(load_single_flight)
    FxGraphCache._save_graph = staticmethod(save_by_role_and_release)
    CompiledFxGraph.after_deserialization = deserialize_with_own_groups
    compile_fx._compile_fx_inner = compile_fx_inner_tracking_locks
    _installed = True
    return True
