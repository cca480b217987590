"""Every private torch (and Python) name core/ relies on is still where it was (torch 2.13): an
upgrade that moves one fails here, naming the module that uses it, not deep inside a run. Each
use carries a one-line comment saying why no public API does it."""

from __future__ import annotations

import dataclasses
import importlib

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from core.toggles import compile_cache

pytestmark = [pytest.mark.core]

ATEN_OPS = (  # the ops selective AC saves and the CP CPU shim handles
    "_scaled_mm",
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_flash_attention_for_cpu_backward",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
)

PRIVATE = [  # (module, attribute path, who uses it)
    ("torch._dynamo.utils", "counters", "core/toggles/compile_cache.py"),
    ("torch._functorch._aot_autograd.autograd_cache", "AOTAutogradCachePickler", "core/toggles/compile_cache.py"),
    ("torch._inductor.runtime.cache_dir_utils", "cache_dir", "core/toggles/compile_cache.py"),
    ("torch._dynamo.variables.misc", "produce_trampoline_autograd_apply", "core/toggles/compile_cache.py"),
    ("torch._inductor.config", "unsafe_marked_cacheable_functions", "core/toggles/compile_cache.py"),
    ("torch._inductor.runtime.cache_dir_utils", "default_cache_dir", "core/toggles/compile.py"),
    ("torch._functorch.config", "enable_autograd_cache", "core/toggles/compile.py"),
    ("torch._inductor.config", "fx_graph_cache", "core/toggles/compile.py"),
    ("torch._inductor.config", "emulate_precision_casts", "core/toggles/compile.py"),
    ("torch._inductor.cpu_vec_isa", "x86_isa_checker", "core/toggles/compile.py"),
    ("torch._inductor.cpu_vec_isa", "supported_vec_isa_list", "core/toggles/compile.py"),
    ("torch.distributed._functional_collectives", "AsyncCollectiveTensor", "core/toggles/compile.py"),
    # a damaged cache file moved aside (issue 51): where a wrapper loads, where an ISA probe lives
    ("torch._inductor.codecache", "PyCodeCache.load_by_key_path", "core/toggles/compile.py"),
    ("torch._inductor.codecache", "write", "core/toggles/compile.py"),
    ("torch._inductor.codecache", "get_lock_dir", "core/toggles/compile.py"),
    ("torch._inductor.codecache", "LOCK_TIMEOUT", "core/toggles/compile.py"),
    ("torch._inductor.cpu_vec_isa", "_get_isa_dry_compile_fingerprint", "core/toggles/compile.py"),
    ("torch._inductor.cpu_vec_isa", "VecISA._avx_code", "core/toggles/compile.py"),
    ("torch.utils._filelock", "FileLock", "core/toggles/compile.py"),
    (
        "torch.distributed.algorithms._checkpoint.checkpoint_wrapper",
        "checkpoint_wrapper",
        "core/toggles/activation_checkpoint.py",
    ),
    ("torch._inductor.config", "_micro_pipeline_tp", "core/toggles/async_tp.py"),
    ("torch.distributed._symmetric_memory", "enable_symm_mem_for_group", "core/toggles/async_tp.py"),
    *[("torch", f"ops.aten.{op}.default", "core/toggles/activation_checkpoint.py") for op in ATEN_OPS],
    ("torch", "ops._c10d_functional.reduce_scatter_tensor.default", "core/toggles/activation_checkpoint.py"),
    ("torch.distributed.distributed_c10d", "_set_pg_timeout", "core/parallel/mesh.py, core/debug.py"),
    ("torch.distributed.distributed_c10d", "_world.pg_map", "core/debug.py"),
    ("torch.distributed", "ProcessGroup._get_backend", "core/debug.py"),
    ("torch._C._distributed_c10d", "_dump_fr_trace", "core/debug.py"),
    ("torch.distributed.device_mesh", "DeviceMesh._flatten", "core/parallel/mesh.py"),
    ("torch.distributed.device_mesh", "DeviceMesh._concatenate", "core/parallel/mesh.py"),
    ("torch.distributed.tensor.experimental._context_parallel._attention", "custom_ops", "core/parallel/context.py"),
    (
        "torch.distributed.tensor.experimental._context_parallel._attention",
        "_templated_ring_attention",
        "core/parallel/context.py",
    ),
    (
        "torch.distributed.tensor.experimental._context_parallel._attention",
        "_templated_ring_attention_backward",
        "core/parallel/context.py",
    ),
    ("torch.distributed.tensor.experimental._attention", "set_rotate_method", "core/parallel/context.py"),
    ("torch.distributed.tensor", "DTensor._op_dispatcher.unwrap_to_op_info", "core/parallel/context.py"),
    ("torch.distributed.tensor._random", "_RNGStateTracker.__init__", "core/build.py"),
    ("torch.distributed.tensor._random", "_rng_tracker", "core/build.py"),
    ("torch.distributed.tensor._random", "OffsetBasedRNGTracker._compute_rng_offsets", "core/build.py"),
    ("torch.distributed.tensor._random", "OffsetBasedRNGTracker._distribute_region", "core/build.py"),
    ("torch", "ops.mkldnn._is_mkldnn_bf16_supported", "core/cpu_gemm.py"),
    ("torch.library", "Library._destroy", "core/cpu_gemm.py"),
    ("torch.distributed.pipelining._schedule_visualizer", "get_schedule_ops", "core/parallel/schedule_sim.py"),
    ("torch.distributed.pipelining.schedules", "_Action", "core/parallel/schedule_sim.py"),
    ("torch._subclasses.fake_tensor", "FakeTensorMode", "core/dryrun/fake_step.py"),
    ("torch.distributed._tools.fsdp2_mem_tracker", "FSDPMemTracker", "core/dryrun/fake_step.py"),
    ("torch.distributed._tools.mem_tracker", "_TOTAL_KEY", "core/dryrun/fake_step.py"),
    ("torch.distributed._tools.mem_tracker", "MemTracker", "core/dryrun/fake_step.py"),
    ("torch.testing._internal.distributed.fake_pg", "FakeStore", "core/dryrun/fake_step.py"),
    ("atexit", "_run_exitfuncs", "core/process.py"),
]


@pytest.mark.parametrize(("module", "path", "user"), PRIVATE, ids=[f"{m}.{p}" for m, p, _ in PRIVATE])
def test_a_private_torch_name_is_still_there(module, path, user):
    obj = importlib.import_module(module)
    for part in path.split("."):
        assert hasattr(obj, part), f"{module}.{path} (used by {user}) is gone in torch {torch.__version__}"
        obj = getattr(obj, part)


def test_what_the_compile_cache_patches_is_still_there():
    """compile_cache.targets(): the functions its patches replace (it imports their private modules)."""
    targets = compile_cache.targets()
    assert set(targets) == set(compile_cache.PATCHES)
    for key, (owner, name) in targets.items():
        assert callable(getattr(owner, name, None)), f"compile cache: {key} ({owner}.{name}) is gone"
    from torch._inductor.output_code import CompiledFxGraph

    # the saved graph's fields the patches read and rewrite
    fields = {f.name for f in dataclasses.fields(CompiledFxGraph)}
    assert {"source_code", "cache_key", "_original_gm"} <= fields


def test_private_instance_attributes_are_still_there(pg):
    """Those only an object has: a mesh's group names (compile_cache), a backend's applied timeout
    (core/debug.py), a checkpoint wrapper's inner module (core/toggles/compile.py)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.distributed.device_mesh import init_device_mesh

    assert hasattr(init_device_mesh("cpu", (1,)), "_dim_group_names")
    backend = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu"))
    assert hasattr(backend.options, "_timeout")
    assert hasattr(checkpoint_wrapper(nn.Linear(2, 2)), "_checkpoint_wrapped_module")
