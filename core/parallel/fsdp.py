"""FSDP2 (`fully_shard`) and HSDP: shard each transformer block, then the root.

HSDP is FSDP2 on a 2-D mesh (dp_replicate, dp_shard_cp): replicate across the first dim,
shard across the second.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from core.parallel.mesh import WorldMesh
from core.parallel.reshard import reshard_after_forward as reshard_policy

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def fsdp_mesh(world_mesh: WorldMesh, dp_replicate: int) -> DeviceMesh:
    if dp_replicate > 1:
        return world_mesh["dp_replicate", "dp_shard_cp"]
    return world_mesh["dp_shard_cp"]


def apply_fsdp(
    model: nn.Module,
    mesh: DeviceMesh,
    param_dtype: str = "float32",
    reduce_dtype: str = "float32",
    reshard_after_forward: str = "default",
    pp_enabled: bool = False,
) -> nn.Module:
    mp = MixedPrecisionPolicy(param_dtype=DTYPES[param_dtype], reduce_dtype=DTYPES[reduce_dtype])
    layers = list(model.layers.values()) if getattr(model, "layers", None) is not None else []
    blocks, root = reshard_policy(reshard_after_forward, len(layers), pp_enabled)
    for block, reshard in zip(layers, blocks, strict=True):
        fully_shard(block, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=root)
    return model
