"""The environment real runs get on a GPU node or a SLURM cluster (used by recipes.launcher, recipes.multinode)."""

from __future__ import annotations

# Real runs: expandable segments cut fragmentation, the head-room the rows near 95 GiB need.
CUDA_ALLOC_CONF = "expandable_segments:True"


def sbatch_env_lines(nproc: int) -> list[str]:
    """The sbatch script's environment, each variable overridable by the submitting shell: CPU
    threads per rank from the node's cores, the allocator, a node-local inductor cache (every
    rank of every node compiling into one folder on the cluster's file system is slow and racy)."""
    return [
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
        f"export PYTORCH_CUDA_ALLOC_CONF=${{PYTORCH_CUDA_ALLOC_CONF:-{CUDA_ALLOC_CONF}}}",
        "export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-${TMPDIR:-/tmp}/titan_inductor_${USER:-user}}",
    ]
