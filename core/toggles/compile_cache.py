"""Ranks of a job share inductor's FX-graph cache (torch 2.13; installed by compile.ensure_cache_dir).

Every rank compiles the same transformer block, so one compile could serve them all. Two things
in torch 2.13 stop that:

1. The cache key of a DTensor graph changes from process to process. Its DeviceMesh inputs are
   pickled whole (this rank, its thread id, its groups) and switch the key's pickler into memo
   mode, so the bytes differ on every rank and in every run: each rank of each run misses.
   Here a mesh is keyed by what compiled code can depend on: device type, dim names, shape.
   Whatever a graph bakes in from the real mesh (coordinates, group names) is in its code, which
   the key hashes anyway.
2. The ranks compile at the same moment, so all of them miss. A file lock per key lets the first
   rank compile and save while the others wait for it, then load its graph (single flight).

This patches three torch internals, so it installs only where their signatures are the ones
written for. No library provides it. A lock is held only while this process compiles, never
across a collective. A compile that fails releases it. A rank that has waited WAIT_S compiles
itself.
"""

from __future__ import annotations

import functools
import logging
import os
import threading

import filelock

log = logging.getLogger(__name__)

WAIT_S = 900.0  # longest wait for another rank's compile of the same graph (16 ranks on 2 cores: ~2 min)
_state = threading.local()  # .held: key -> lock, for the compile running on this thread
_installed = False


def counts() -> dict[str, int]:
    """This process's FX-graph cache lookups so far (torch's counters): hit, miss, bypass."""
    from torch._dynamo.utils import counters

    return {k: counters["inductor"][f"fxgraph_cache_{k}"] for k in ("hit", "miss", "bypass")}


def counts_of_all_ranks(since: dict[str, int]) -> dict[str, int]:
    """Lookups since `since`, summed over the ranks (collective: every rank calls it)."""
    import torch.distributed as dist

    mine = {k: v - since[k] for k, v in counts().items()}
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return {k: sum(c[k] for c in every) for k in mine}


def mesh_cache_key(*parts):
    """What a DeviceMesh contributes to a cache key: (device type, dim names, shape)."""
    return parts


def _mesh_reduce(mesh):
    return mesh_cache_key, (mesh.device_type, mesh.mesh_dim_names, tuple(mesh.mesh.shape))


def _lock_path(key: str) -> str:
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    folder = os.path.join(cache_dir(), "titan_fxgraph_locks")
    os.makedirs(folder, exist_ok=True)
    return os.path.join(folder, f"{key}.lock")


def install() -> bool:
    """Patch the pickler of cache keys and the FX-graph cache (idempotent). False if this torch
    does not have the internals the patches were written for (nothing is patched then)."""
    global _installed
    if _installed:
        return True
    import torch._inductor.compile_fx as compile_fx
    from torch._inductor.codecache import FxGraphCache, FxGraphCachePickler
    from torch.distributed.device_mesh import DeviceMesh

    needed = (
        getattr(FxGraphCachePickler, "_reduce_fake_script_object", None),
        getattr(FxGraphCache, "load_with_key", None),
        getattr(FxGraphCache, "_save_graph", None),
        getattr(compile_fx, "_compile_fx_inner", None),
    )
    if not all(callable(f) for f in needed):
        log.warning("compile cache: this torch lacks the FX-graph cache internals; ranks compile alone")
        return False
    reduce_script_object, load_with_key, save_graph, compile_fx_inner = needed

    def reduce_script_object_stably(self, t):
        if isinstance(t.real_obj, DeviceMesh):  # instead of pickling the mesh whole (and in memo mode)
            return _mesh_reduce(t.real_obj)
        return reduce_script_object(self, t)

    init = FxGraphCachePickler.__init__

    @functools.wraps(init)
    def init_with_mesh(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.dispatch_table[DeviceMesh] = _mesh_reduce  # a mesh held by the graph module itself

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

    def save_and_release(key, *args, **kwargs):
        try:
            return save_graph(key, *args, **kwargs)
        finally:
            lock = getattr(_state, "held", {}).pop(key, None)
            if lock is not None:
                lock.release()

    def compile_fx_inner_tracking_locks(*args, **kwargs):
        outer, _state.held = getattr(_state, "held", None), {}
        try:
            return compile_fx_inner(*args, **kwargs)
        finally:
            for lock in _state.held.values():  # a compile that failed never saved: let the others in
                lock.release()
            _state.held = outer

    FxGraphCachePickler._reduce_fake_script_object = reduce_script_object_stably
    FxGraphCachePickler.__init__ = init_with_mesh
    FxGraphCache.load_with_key = staticmethod(load_single_flight)
    FxGraphCache._save_graph = staticmethod(save_and_release)
    compile_fx._compile_fx_inner = compile_fx_inner_tracking_locks
    _installed = True
    return True
