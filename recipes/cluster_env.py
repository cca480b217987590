"""The environment real runs get on a GPU node or a SLURM cluster (used by recipes.launcher, recipes.multinode)."""

from __future__ import annotations

import os
from pathlib import Path

# Real runs: expandable segments cut fragmentation, the head-room the rows near 95 GiB need.
CUDA_ALLOC_CONF = "expandable_segments:True"


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


def node_env_assignments() -> list[str]:
    """`NAME=value` shell words of what every real launch sets on its node (the local launch sets
    them itself, recipes/modes.py RealMode.env): the allocator, and a node-local inductor cache
    (every rank of every node compiling into one folder on the cluster's file system is slow and
    racy). Each keeps a value the node's shell already has."""
    return [
        f"PYTORCH_CUDA_ALLOC_CONF=${{PYTORCH_CUDA_ALLOC_CONF:-{CUDA_ALLOC_CONF}}}",
        "TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-${TMPDIR:-/tmp}/titan_inductor_${USER:-user}}",
    ]


def sbatch_env_lines(nproc: int) -> list[str]:
    """The sbatch script's environment, each variable overridable by the submitting shell: CPU
    threads per rank from the node's cores, the allocator, a node-local inductor cache (every
    rank of every node compiling into one folder on the cluster's file system is slow and racy)."""
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
        *(f"export {assignment}" for assignment in node_env_assignments()),
    ]
