"""AsyncTP: micro-pipelined tensor parallelism (the paper's 2D/3D rows).

Inductor splits each TP all-gather -> matmul and matmul -> reduce-scatter into chunks and
overlaps the communication of one chunk with the matmul of another, through symmetric memory
(direct GPU-to-GPU loads/stores). Two switches, as torchtitan does:
`torch._inductor.config._micro_pipeline_tp = True` (the inductor pass: so it needs compile) and
`enable_symm_mem_for_group(<tp group>)`.

Needs: CUDA GPUs joined by NVLink/NVSwitch (peer-to-peer access between every pair of the
node's GPUs), tensor parallelism (tp > 1) and compile — the last two are checked by
core.validate.validate. On anything else: real mode refuses before launch (ConfigError naming the
requirement); proxy mode runs without it and records `toggles_skipped["async_tp"]` with the
reason (on CPU symmetric memory does not exist and the inductor pass would fuse nothing).
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

from core.config import ConfigError, JobConfig
from core.process import once_per_node

REQUIREMENT = "AsyncTP needs CUDA GPUs connected by NVLink/NVSwitch (symmetric memory) and compile"
# "1" / "0": the node's NVLink verdict, given (a test, a launcher that probed): nothing is probed
NVLINK_ENV = "TITAN_NVLINK_ALL_PAIRS"


def _nvlink_between_all_gpus(n: int) -> bool:
    """Whether NVLink joins every pair of the node's first n GPUs: NVLINK_ENV where set, else
    nvidia-smi's verdict, asked once per process and run once per node (it takes up to 20 s, and
    every rank asks at start and once per pipeline stage); without nvidia-smi, CUDA peer access
    alone decides (True here)."""
    given = os.environ.get(NVLINK_ENV)
    if given in ("0", "1"):
        return given == "1"
    return _node_verdict(n)


@functools.cache
def _node_verdict(n: int) -> bool:
    if shutil.which("nvidia-smi") is None:
        return True
    return once_per_node(f"nvlink_{n}", lambda: "1" if _topology_shows_nvlink(n) else "0") == "1"


def _topology_shows_nvlink(n: int) -> bool:
    """nvidia-smi's topology matrix shows NV<k> (NVLink, through NVSwitch on HGX) for every GPU
    pair (a topology it cannot give counts as NVLink: peer access decides)."""
    try:
        out = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.TimeoutExpired):
        return True
    rows = [line.split() for line in out.splitlines() if line.startswith("GPU")]
    for i, row in enumerate(rows[:n]):
        links = row[1 : 1 + n]
        if any(j != i and not link.startswith("NV") for j, link in enumerate(links)):
            return False
    return True


def hardware_problem(cfg: JobConfig) -> str | None:
    """Why this machine cannot run AsyncTP, or None."""
    if not cfg.parallelism.enable_async_tp:
        return None
    if not torch.cuda.is_available():
        return f"{REQUIREMENT}; this machine has no CUDA device"
    n = torch.cuda.device_count()
    pairs = [(i, j) for i in range(n) for j in range(n) if i != j]
    if any(not torch.cuda.can_device_access_peer(i, j) for i, j in pairs):
        return f"{REQUIREMENT}; the {n} GPUs here lack peer-to-peer access"
    if not _nvlink_between_all_gpus(n):
        return f"{REQUIREMENT}; nvidia-smi topo shows GPU pairs without NVLink"
    return None


def apply_async_tp(tp_mesh: DeviceMesh, cfg: JobConfig, toggles) -> bool:
    """Enable AsyncTP on tp_mesh's group when this machine can; returns whether it did.

    Real mode raises ConfigError when it cannot (the launcher's node check normally refused
    earlier); proxy mode records the skip with the reason.
    """
    if not cfg.parallelism.enable_async_tp:
        return False
    problem = hardware_problem(cfg)
    if problem is None and not cfg.compile.enabled:
        problem = f"{REQUIREMENT}; compile.enabled is false"
    if problem:
        if cfg.job.mode == "real":
            raise ConfigError(f"parallelism.enable_async_tp: {problem}")
        toggles.skip("async_tp", problem)
        return False
    import torch._inductor.config as inductor_config  # ~1 s import: AsyncTP runs only

    inductor_config._micro_pipeline_tp = True  # private flag: the only switch for inductor's AsyncTP pass
    # private: symmetric memory has no public module yet; imported here, as AsyncTP alone needs it
    import torch.distributed._symmetric_memory as symm_mem

    symm_mem.enable_symm_mem_for_group(tp_mesh.get_group().group_name)
    toggles.apply("async_tp")
    return True
