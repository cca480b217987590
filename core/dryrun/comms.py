"""Which link a mesh dimension's collectives use, and how long a collective takes on it.

Mesh order (core/parallel/mesh.py): pp, dp_replicate, dp_shard, cp, tp (tp innermost), ranks
numbered row-major, `gpus_per_node` consecutive ranks per node. A group of consecutive mesh
dimensions has a stride (the product of the sizes inside it) and a size; it stays inside a node
when stride x size <= gpus_per_node (NVLink), else it spans nodes (RDMA).

Across nodes NCCL runs one ring per NIC: with g of the group's ranks in each node, the g rings
cross each node boundary on g different NICs, so the group moves data at g x the per-GPU network
bandwidth (at most NVLink's). Ring collectives (NCCL's Simple protocol, large messages):
    all-gather / reduce-scatter of S bytes (the gathered size) over n ranks:
        base + (n - 1) x step latency + (n - 1) / n x S / bandwidth
    all-reduce: a reduce-scatter then an all-gather.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

MESH_ORDER = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


@dataclass(frozen=True)
class Link:
    label: str  # the mesh dimension(s), e.g. "dp_shard_cp"
    size: int  # ranks in the group
    nodes_spanned: bool
    bandwidth: float  # achieved bytes/s per rank for ring collectives
    step_latency: float
    base_latency: float

    def ring(self, nbytes: float) -> float:
        """All-gather or reduce-scatter whose gathered size is nbytes."""
        n = self.size
        if n <= 1 or nbytes <= 0:
            return 0.0
        return self.base_latency + (n - 1) * self.step_latency + (n - 1) / n * nbytes / self.bandwidth

    def all_reduce(self, nbytes: float) -> float:
        if self.size <= 1 or nbytes <= 0:
            return 0.0
        return 2 * self.ring(nbytes) - self.base_latency

    def small_all_reduce(self) -> float:
        """A few scalars (grad norm, loss-parallel max/sum): NCCL's tree, latency only."""
        if self.size <= 1:
            return 0.0
        return self.base_latency + 2 * math.ceil(math.log2(self.size)) * self.step_latency

    def p2p(self, nbytes: float) -> float:
        """One send/recv to a neighbour (PP): one step, the bandwidth of a single rank's link."""
        if self.size <= 1 or nbytes <= 0:
            return 0.0
        return self.base_latency + self.step_latency + nbytes / self.bandwidth


def link(spec, sizes: dict[str, int], dims: tuple[str, ...]) -> Link:
    """The link of the group spanning the consecutive mesh dims `dims` (in MESH_ORDER)."""
    idx = [MESH_ORDER.index(d) for d in dims]
    if idx != list(range(idx[0], idx[-1] + 1)):
        raise ValueError(f"mesh dims {dims} are not consecutive in {MESH_ORDER}")
    stride = math.prod(sizes[d] for d in MESH_ORDER[idx[-1] + 1 :])
    size = math.prod(sizes[d] for d in dims)
    gpn = spec.gpus_per_node
    nvlink = spec.nvlink_bandwidth * spec.nccl_nvlink
    if stride * size <= gpn:
        bw, lat, spans = nvlink, spec.nvlink_latency_s, False
    else:
        per_node = max(1, min(size, gpn // stride)) if stride < gpn else 1
        bw = min(per_node * spec.network_bandwidth * spec.nccl_rdma, nvlink)
        lat, spans = spec.network_latency_s, True
    return Link("_".join(dims), size, spans, bw, lat, spec.collective_base_latency_s)


def mesh_links(spec, sizes: dict[str, int], fsdp_dims: tuple[str, ...]) -> dict[str, Link]:
    """The links the step uses: fsdp (dp_shard [x cp]), dp_replicate, tp, cp, pp, and the whole
    world (grad-norm all-reduce)."""
    out = {"fsdp": link(spec, sizes, fsdp_dims)}
    for d in ("dp_replicate", "tp", "cp", "pp"):
        out[d] = link(spec, sizes, (d,))
    out["world"] = link(spec, sizes, MESH_ORDER)
    return out
