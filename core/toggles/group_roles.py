"""This process's process groups and device meshes by role, for compiled code shared among ranks
(core/toggles/compile_cache.py).

A TP or CP graph names its process group in its code ('27' on ranks 0-1, '28' on ranks 2-3), and
an AOTAutograd cache entry pickles the DeviceMesh of its DTensors whole (this rank, its
coordinates, its groups' names). What a graph needs from either is its role: the mesh dim (or
flattened view) it belongs to. Code is saved with roles in place of names and loaded with this
rank's names put back; a mesh is saved as its dim names and loaded as this job's mesh of those
dims. `name_groups` registers both for each job.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

GROUP_TOKEN = "titan-group:"  # a role as written in keys and saved code: 'titan-group:tp'
_role_of_name: dict[str, str] = {}  # this process's group name -> role
_name_of_role: dict[str, str] = {}
_mesh_of_dims: list[Callable[[tuple[str, ...]], Any]] = []  # this job's mesh (or view) of some dim names
_OP_LINE = re.compile(r"^.*torch\.ops\..*$", re.M)  # group names are arguments of c10d/symm_mem ops
_TOKEN = re.compile(r"'" + GROUP_TOKEN + r"(\w+)'")


def name_groups(roles: dict[str, str], meshes: Callable[[tuple[str, ...]], Any] | None = None) -> None:
    """This process's groups by role (mesh dim or flattened view -> group name), replacing any
    earlier job's. A group under two roles keeps the first: every rank registers in one order.
    `meshes`: this job's mesh of some dim names (core.parallel.mesh.WorldMesh indexing)."""
    _role_of_name.clear()
    _name_of_role.clear()
    _mesh_of_dims.clear()
    for role, name in roles.items():
        if name not in _role_of_name:
            _role_of_name[name] = role
            _name_of_role[role] = name
    if meshes is not None and roles:
        _mesh_of_dims.append(meshes)


def registered() -> bool:
    """Whether groups are registered by role (a multi-rank job)."""
    return bool(_role_of_name)


def roles_of(names: tuple[str, ...]) -> tuple[str, ...] | None:
    """The roles of these group names; None if one is not registered (or no job mesh is)."""
    if not _mesh_of_dims or any(n not in _role_of_name for n in names):
        return None
    return tuple(_role_of_name[n] for n in names)


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


def names_unregistered_groups(code: str) -> bool:
    """Whether an op call in `code` names a process group of this process that has no role (a
    mesh left from an earlier job in this process): such code is not the same program on ranks of
    another group, so it is shared by name only."""
    from torch.distributed.distributed_c10d import _world  # private: every group's name (no public list)

    names = {repr(name) for name in _world.pg_names.values()} - {repr(name) for name in _role_of_name}
    return any(name in line for line in _OP_LINE.findall(code) for name in names)


def local_code(code: str) -> str:
    """Saved code with this process's group put back for each role."""

    def name(m: re.Match) -> str:
        if m.group(1) not in _name_of_role:
            raise RuntimeError(f"compiled code from the cache uses group role {m.group(1)!r}, not registered here")
        return repr(_name_of_role[m.group(1)])

    return _TOKEN.sub(name, code)


def job_mesh(device_type: str, dim_names: tuple[str, ...], shape: tuple[int, ...]) -> Any:
    """This job's mesh of `dim_names` (what a mesh saved by role loads as); raises if there is none
    of that device type and shape (the cache then treats the entry as a miss)."""
    if not _mesh_of_dims:
        raise RuntimeError("a cached graph holds a mesh saved by role, and no job mesh is registered here")
    mesh = _mesh_of_dims[0](tuple(dim_names))
    if mesh.device_type != device_type or tuple(mesh.mesh.shape) != tuple(shape):
        raise RuntimeError(
            f"this job's {dim_names} mesh is {mesh.device_type} {tuple(mesh.mesh.shape)}, not {device_type} {shape}"
        )
    return mesh
