"""Every private torch name the project relies on (no public API does the job in torch 2.13; each
use has a comment saying why). When torch moves one, this test names it before a run fails."""

from __future__ import annotations

import importlib

import pytest

pytestmark = pytest.mark.core

# (module, attribute path) as the code uses them
PRIVATE = [
    ("torch.distributed.distributed_c10d", "_set_pg_timeout"),  # core/debug.py, core/parallel/mesh.py
    ("torch.distributed.distributed_c10d", "_world.pg_map"),  # core/debug.py: every group
    ("torch.distributed", "ProcessGroup._get_backend"),  # core/debug.py: a group's timeout
    ("torch._C._distributed_c10d", "_dump_fr_trace"),  # core/debug.py: the Flight Recorder on gloo
    ("torch.distributed.tensor._random", "_RNGStateTracker"),  # core/build.py: CPU offset RNG
    ("torch.distributed.tensor._random", "OffsetBasedRNGTracker._compute_rng_offsets"),
    ("torch.distributed.tensor._random", "_rng_tracker"),
    ("torch.distributed.device_mesh", "DeviceMesh._flatten"),  # core/parallel/mesh.py
    ("torch.distributed.device_mesh", "DeviceMesh._concatenate"),
    ("torch.distributed.algorithms._checkpoint.checkpoint_wrapper", "checkpoint_wrapper"),  # AC
    ("torch.distributed._symmetric_memory", "enable_symm_mem_for_group"),  # AsyncTP
    ("torch._inductor.config", "_micro_pipeline_tp"),
    ("torch.distributed.tensor.experimental._context_parallel._attention", "_templated_ring_attention"),  # CP
    ("torch.distributed.tensor.experimental._context_parallel._attention", "_templated_ring_attention_backward"),
    ("torch.ops.mkldnn", "_is_mkldnn_bf16_supported"),  # core/cpu_gemm.py
    ("torch.library", "Library._destroy"),
    ("atexit", "_run_exitfuncs"),  # core/process.py: atexit handlers before os._exit
]


def _resolve(module: str, path: str) -> None:
    """Raises AttributeError / ImportError naming the part that moved."""
    if module.startswith("torch.ops."):
        import torch

        obj = torch.ops
        for part in module.split(".")[2:]:
            obj = getattr(obj, part)
    else:
        obj = importlib.import_module(module)
    for part in path.split("."):
        obj = getattr(obj, part)


@pytest.mark.parametrize(("module", "path"), PRIVATE, ids=[f"{m}:{p}" for m, p in PRIVATE])
def test_private_torch_name_is_where_the_code_uses_it(module, path):
    _resolve(module, path)  # _rng_tracker is None until set: its presence is what matters
