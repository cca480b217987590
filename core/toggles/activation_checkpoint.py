"""Activation checkpointing per transformer block: none | full | selective (per layer or per op).

- full: every block runs under non-reentrant `torch.utils.checkpoint` (via `checkpoint_wrapper`);
  only the block inputs survive the forward, everything inside is recomputed in backward.
- selective, option k (an integer): every k-th block (global layer id + 1 divisible by k) is
  fully checkpointed, the others keep their activations. The choice uses the global layer id
  so a pipeline split does not change which blocks recompute.
- selective, option "op": every block is checkpointed with torch's
  `create_selective_checkpoint_contexts`: the outputs of the expensive ops (matmuls, attention,
  reduce-scatter, float8 amax) are saved, the cheap pointwise ops are recomputed.

No dropout in the model, so the RNG state need not be replayed (preserve_rng_state=False).
"""

from __future__ import annotations

import functools
from collections import defaultdict

import torch
import torch.nn as nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper  # private: no public one
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from core.config import ActivationCheckpoint

aten = torch.ops.aten

# Ops whose outputs selective op AC saves (their recompute costs FLOPs or communication). The
# underscored ATen / c10d ops are what matmul, SDPA and TP dispatch to: a policy sees only those.
SAVE_OPS = {
    aten.mm.default,
    aten._scaled_mm.default,  # float8 matmuls
    aten._scaled_dot_product_flash_attention.default,
    aten._scaled_dot_product_flash_attention_for_cpu.default,  # the CPU SDPA kernel
    aten._scaled_dot_product_efficient_attention.default,
    aten._scaled_dot_product_cudnn_attention.default,
    torch.ops._c10d_functional.reduce_scatter_tensor.default,  # TP: comm is not free to redo
    # float8 amax: saving it keeps the recomputed casts bit-identical and skips a reduction.
    aten.max.default,
}


def op_sac_policy(save_every_other_mm: bool = False):
    """A policy for `create_selective_checkpoint_contexts`: save SAVE_OPS, recompute the rest.

    save_every_other_mm: torchtitan's variant, recompute every second matmul (less memory, more
    compute). Off by default: on the CPU proxy the matmuls are most of the step's time.
    """
    counts = defaultdict(int)

    def policy(ctx, func, *args, **kwargs):
        if func == aten.mm.default and save_every_other_mm:
            key = "recompute" if ctx.is_recompute else "forward"
            counts[key] += 1
            if counts[key] % 2 == 0:
                return CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.MUST_SAVE if func in SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def _op_sac_contexts(save_every_other_mm: bool = False):
    # A fresh policy (and mm counter) per checkpointed call: forward and recompute must agree.
    return create_selective_checkpoint_contexts(op_sac_policy(save_every_other_mm))


def _op_context_fn(save_every_other_mm: bool = False):
    """The block's `context_fn`: a partial of a module-level function, so inductor can pickle it
    into its FX-graph cache key (a local closure makes every compile bypass that cache)."""
    context_fn = functools.partial(_op_sac_contexts, save_every_other_mm)
    # A stable name of the policy lets AOTAutograd's cache serve compiled blocks across processes
    # (without it every rank of every run compiles afresh); it changes whenever SAVE_OPS does.
    saved = ",".join(sorted(str(op) for op in SAVE_OPS))
    context_fn.cache_hash = f"titan-op-sac:{saved}:every_other_mm={save_every_other_mm}"
    return context_fn


def _blocks(model: nn.Module):
    layers = getattr(model, "layers", None)
    if layers is None:
        return []
    return [(name, block) for name, block in layers.named_children() if block is not None]


def wrap_block(block: nn.Module, mode: str, save_every_other_mm: bool = False) -> nn.Module:
    """mode "full" or "op": the block wrapped for recompute (FQNs gain `_checkpoint_wrapped_module`,
    which torch's state_dict helpers strip)."""
    if mode == "full":
        wrapped = checkpoint_wrapper(block, preserve_rng_state=False)
    elif mode == "op":
        wrapped = checkpoint_wrapper(block, context_fn=_op_context_fn(save_every_other_mm), preserve_rng_state=False)
    else:
        raise ValueError(f"unknown AC mode {mode!r}")
    wrapped.ac_mode = mode  # read by core.toggles.compile
    return wrapped


def toggle_name(ac: ActivationCheckpoint) -> str | None:
    """The record name of an AC config: ac:full | ac:op | ac:layer<k> (None for mode none)."""
    if ac.mode == "none":
        return None
    if ac.mode == "full":
        return "ac:full"
    return "ac:op" if ac.selective_ac_option == "op" else f"ac:layer{int(ac.selective_ac_option)}"


def apply_ac(model: nn.Module, ac: ActivationCheckpoint, toggles, save_every_other_mm: bool = False) -> nn.Module:
    """Wrap model.layers' blocks in place per `ac` (see the module docstring). Returns model."""
    name = toggle_name(ac)
    if name is None:
        return model
    blocks = _blocks(model)
    if ac.mode == "full":
        chosen = [(n, "full") for n, _ in blocks]
    elif ac.selective_ac_option == "op":
        chosen = [(n, "op") for n, _ in blocks]
    else:
        k = int(ac.selective_ac_option)
        chosen = [(n, "full") for n, _ in blocks if (int(n) + 1) % k == 0]
    for n, mode in chosen:
        model.layers.register_module(n, wrap_block(model.layers.get_submodule(n), mode, save_every_other_mm))
    if blocks:
        toggles.apply(name)
    else:
        toggles.skip(name, "this pipeline stage holds no transformer blocks")
    return model
