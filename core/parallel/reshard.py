"""FSDP's reshard policy: which FSDP units free their gathered parameters after forward (and
gather them again in backward). Torch-free: core/parallel/fsdp.py applies it, the dry run
(core/dryrun/memory.py, core/dryrun/runtime.py) prices it.

`parallelism.fsdp_reshard_after_forward` as torchtitan defines it (pytorch/torchtitan PR 822,
torchtitan/config_manager.py): `always` reshards every block and the root, `never` none; `default`
reshards every block but the last (FSDP would prefetch it again at once) and, under PP, none
(several microbatches reuse them). FSDP2's `reshard_after_forward` (torch fully_shard): True frees
the unsharded parameters after forward and all-gathers them again in backward; False keeps them
from forward to backward and skips that all-gather.
"""

from __future__ import annotations


def reshard_after_forward(policy: str, n_layers: int, pp_enabled: bool) -> tuple[list[bool], bool]:
    """(each block's reshard_after_forward, the root's) under `policy`."""
    if policy not in ("default", "always", "never"):
        raise ValueError(f"parallelism.fsdp_reshard_after_forward: {policy!r} is none of default, always, never")
    if policy != "default":
        return [policy == "always"] * n_layers, policy == "always"
    reshard = not pp_enabled
    return [reshard and i < n_layers - 1 for i in range(n_layers)], reshard
