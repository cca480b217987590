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
    # default: with PP, several microbatches reuse the parameters between forward and backward,
    # and keeping them gathered saves one all-gather per microbatch.
    reshard = not pp_enabled if reshard_after_forward == "default" else reshard_after_forward == "always"
    layers = list(model.layers.values()) if getattr(model, "layers", None) is not None else []
    for i, block in enumerate(layers):
        # The last block's parameters are needed again at once by backward: keep them.
        fully_shard(block, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard and i < len(layers) - 1)
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard)
    return model
