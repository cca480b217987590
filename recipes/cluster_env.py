"""The environment of every launch, one list for the local launch (recipes.launcher base_env,
recipes.modes RealMode.env) and the multi-node ones (recipes.multinode: the printed command, the
sbatch script), and what a real run needs of a cluster's file systems."""

from __future__ import annotations

import os
import shlex
from pathlib import Path

from recipes.paths import project_root

# Real runs: expandable segments cut fragmentation, the head-room the rows near 95 GiB need.
CUDA_ALLOC_CONF = "expandable_segments:True"

# Every launch, where the caller's environment has none (base_env; the multi-node ones as `${X:-v}`).
LAUNCH_ENV = {"PYTHONUNBUFFERED": "1"}  # the ranks' lines reach the log as they are printed
# A launch with --max-restarts adds these. pytorch#135712: workers restarted by torchrun on the
# rendezvous' shared TCPStore can read the previous attempt's addresses (gloo: "connectFullMesh
# failed"). Not for every torchrun launch: rank 0 then binds a port torchrun chose earlier, which
# another process may take meanwhile (EADDRINUSE; our agents reserve it, recipes/reserved_port.py,
# a cluster's own torchrun does not). Forked proxy launches set it always (recipes/forked_run.py).
UNSHARED_STORE_ENV = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"
RESTART_ENV = {UNSHARED_STORE_ENV: "1"}


def launch_env(max_restarts: int = 0) -> dict[str, str]:
    """What every launch sets (where the caller's environment has none), with restarts or without."""
    return {**LAUNCH_ENV, **(RESTART_ENV if max_restarts else {})}


# A real run's own, besides a node-local inductor cache (node_local_cache_dir).
REAL_ENV = {"PYTORCH_CUDA_ALLOC_CONF": CUDA_ALLOC_CONF}


def node_local_cache_dir() -> str:
    """Inductor's cache of a real run on this node: under $TMPDIR (or /tmp), per user, as the sbatch
    script sets it, not in the checkout (often NFS: slow and racy with every rank compiling)."""
    return str(Path(os.environ.get("TMPDIR") or "/tmp") / f"titan_inductor_{os.environ.get('USER') or 'user'}")


# File systems every node of a cluster mounts alike (what a multi-node run's folder must be on).
SHARED_FS = ("nfs", "nfs4", "lustre", "gpfs", "beegfs", "cifs", "smb3", "ceph", "fuse.ceph", "wekafs", "panfs")
NODE_LOCAL_DIRS = ("/tmp", "/var/tmp", "/dev/shm", "/scratch/local")


def _mount_of(path: Path) -> tuple[str, str]:
    """(mount point, file-system type) holding `path` (Linux /proc/mounts; ("", "") elsewhere)."""
    try:
        mounts = [line.split()[1:3] for line in Path("/proc/mounts").read_text().splitlines()]
    except OSError:
        return "", ""
    path_s = str(path)
    best = max(
        (m for m in mounts if path_s == m[0] or path_s.startswith(m[0].rstrip("/") + "/")),
        key=lambda m: len(m[0]),
        default=("", ""),
    )
    return best[0], best[1]


def node_local_reason(path: Path) -> str | None:
    """Why `path` may not be visible from the other nodes of a job, or None when it is on a
    shared file system. A guess from the mount table: say it, never refuse on it."""
    path = Path(path).resolve()
    mount, fstype = _mount_of(path)
    if any(str(path) == d or str(path).startswith(d + "/") for d in NODE_LOCAL_DIRS) or fstype == "tmpfs":
        return f"{path} is node-local ({fstype or 'a local folder'} at {mount or '/'})"
    if fstype and fstype not in SHARED_FS:
        return f"{path} is on {fstype} at {mount}, not a file system the nodes share by nature"
    return None


def real_env_defaults() -> dict[str, str]:
    """What a local real launch sets where the caller's environment has none (over LAUNCH_ENV)."""
    return {**REAL_ENV, "TORCHINDUCTOR_CACHE_DIR": node_local_cache_dir()}


def node_env_assignments(max_restarts: int = 0) -> list[str]:
    """`NAME=value` shell words of what every real launch sets on its node, as the local launch
    does (base_env + real_env_defaults; tests/test_issue51_launch.py holds them equal): the
    checkout first on the path, launch_env, REAL_ENV and a node-local inductor cache (every rank of
    every node compiling into one folder on the cluster's file system is slow and racy). Each
    keeps a value the node's shell already has; the path is the node's own after the checkout."""
    fixed = {**REAL_ENV, **launch_env(max_restarts)}
    if any(shlex.quote(v) != v for v in fixed.values()):  # written unquoted inside ${X:-v}
        raise ValueError(f"a launch setting is not a plain shell word: {fixed}")
    return [
        f"PYTHONPATH={shlex.quote(str(project_root()))}${{PYTHONPATH:+:$PYTHONPATH}}",
        *(f"{k}=${{{k}:-{v}}}" for k, v in fixed.items()),
        "TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-${TMPDIR:-/tmp}/titan_inductor_${USER:-user}}",
    ]


def sbatch_env_lines(nproc: int, max_restarts: int = 0) -> list[str]:
    """The sbatch script's environment, each variable overridable by the submitting shell: CPU
    threads per rank from the node's cores, then what every real launch sets (node_env_assignments)."""
    return [
        # the open-file limit SLURM passes on may be a soft 1024: gloo's groups at 512 ranks need more
        # (the trainer raises it too: core/process.py raise_open_file_limit); srun hands it to the tasks
        'ulimit -n "$(ulimit -Hn)" 2>/dev/null || true',
        "cpus_per_node=${SLURM_CPUS_ON_NODE:-$(nproc)}",
        # torchrun binds each rank to the CPUs near its GPU (it needs numactl; TITAN_NUMA_BINDING=""
        # turns it off, or names another of torchrun's modes)
        'numa_flag=""',
        'if command -v numactl >/dev/null 2>&1 && [ -n "${TITAN_NUMA_BINDING-node}" ]; then',
        '    numa_flag="--numa-binding=${TITAN_NUMA_BINDING-node}"',
        "fi",
        # OMP threads per rank: the node's cores over the ranks, at least 1.
        f"export OMP_NUM_THREADS=${{OMP_NUM_THREADS:-$(( cpus_per_node / {nproc} > 0 ? "
        f"cpus_per_node / {nproc} : 1 ))}}",
        *(f"export {assignment}" for assignment in node_env_assignments(max_restarts)),
    ]
