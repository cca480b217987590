"""Parallel degrees -> one DeviceMesh with named dims (pp, dp_replicate, dp_shard, cp, tp).

All five dims always exist (size-1 dims are free), so every module asks for the dim it needs
by name. Flattened views: `dp` (data loading: ranks that see different batches),
`dp_shard_cp` (FSDP shards parameters over dp_shard x cp, as torchtitan does) and `dp_cp`
(loss averaging and gradient reduction span every rank that sees different tokens).
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.distributed_c10d import _set_pg_timeout  # private: no public live-timeout setter

from core.config import Parallelism

MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


@dataclass
class ParallelDims:
    dp_replicate: int
    dp_shard: int
    cp: int
    tp: int
    pp: int
    world_size: int

    @classmethod
    def from_config(cls, p: Parallelism) -> ParallelDims:
        return cls(p.dp_replicate, p.dp_shard, p.cp, p.tp, p.pp, p.world_size)

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def fsdp_enabled(self) -> bool:
        # CP ranks hold different tokens, so their gradients must be reduced by FSDP too.
        return self.dp_replicate * self.dp_shard * self.cp > 1

    @property
    def non_data_parallel_size(self) -> int:
        return self.cp * self.tp * self.pp

    def build_mesh(self, device_type: str, timeout_seconds: float | None = None) -> WorldMesh:
        """`timeout_seconds` (the first step's, core.debug.first_step_timeout): given to every sub-group
        the mesh creates, which would otherwise keep the backend's default whatever the default group has."""
        sizes = (self.pp, self.dp_replicate, self.dp_shard, self.cp, self.tp)
        root = init_device_mesh(device_type, sizes, mesh_dim_names=MESH_DIMS)
        # private: DeviceMesh has no public flatten (torchtitan's way to the dp / dp_cp views)
        flat = {name: root[dims]._flatten(name) for name, dims in FLATTENED.items()}
        mesh = WorldMesh(root, flat)
        if timeout_seconds is not None:
            mesh_group_timeouts(mesh, timeout_seconds)
        return mesh


# Flattened views and the mesh dims each spans.
FLATTENED = {
    "dp": ("dp_replicate", "dp_shard"),
    "dp_shard_cp": ("dp_shard", "cp"),
    "dp_cp": ("dp_replicate", "dp_shard", "cp"),
}


class WorldMesh:
    """The 5-D mesh and its flattened views, indexed by dim names like a DeviceMesh.

    torch deprecates slicing a flattened dim from the root mesh ("users need to bookkeep the
    flattened mesh directly"): the views `_flatten` returned are kept here and handed out, and a
    mesh mixing a root dim with a view (HSDP's dp_replicate x dp_shard_cp) is concatenated.
    """

    def __init__(self, root: DeviceMesh, flat: dict[str, DeviceMesh]):
        self.root = root
        self.flat = flat
        # One object per view: torch builds a new DeviceMesh per slice, and compiled blocks guard
        # on the mesh object, so pipeline stages sliced apart would each compile their blocks.
        self._views: dict[tuple[str, ...], DeviceMesh] = {}

    def __getitem__(self, names: str | tuple[str, ...]) -> DeviceMesh:
        names = (names,) if isinstance(names, str) else tuple(names)
        if names not in self._views:
            self._views[names] = self._view(names)
        return self._views[names]

    def _view(self, names: tuple[str, ...]) -> DeviceMesh:
        if not any(n in self.flat for n in names):
            return self.root[names]
        if len(names) == 1:
            return self.flat[names[0]]
        return DeviceMesh._concatenate([self[n] for n in names])  # private: no public mesh concatenation

    def __repr__(self) -> str:
        return f"WorldMesh({self.root}, flattened={sorted(self.flat)})"


def mesh_groups(mesh: WorldMesh) -> list:
    """Every process group of the mesh this rank belongs to (each dim, each flattened view)."""
    groups = [mesh.root.get_group(name) for name in MESH_DIMS]
    groups += [view.get_group() for view in mesh.flat.values()]
    return list({id(g): g for g in groups}.values())


def group_roles(mesh: WorldMesh) -> dict[str, str]:
    """This rank's process group of each mesh dim and flattened view, by dim name: the group's
    name differs from one group of a dim to the next (ranks 0-1 vs 2-3), its role does not."""
    roles = {name: mesh.root.get_group(name).group_name for name in MESH_DIMS}
    roles.update({name: view.get_group().group_name for name, view in mesh.flat.items()})
    return roles


def mesh_group_timeouts(mesh: WorldMesh, seconds: float) -> None:
    timeout = datetime.timedelta(seconds=seconds)
    for group in mesh_groups(mesh):
        _set_pg_timeout(timeout, group)


def spmd_mesh(mesh: WorldMesh) -> DeviceMesh:
    """The non-PP sub-mesh of this rank: the ranks of its pipeline stage (the DTensor RNG's domain)."""
    return mesh.root[tuple(d for d in MESH_DIMS if d != "pp")]


def device_type() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"
