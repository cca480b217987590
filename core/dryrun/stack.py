"""What the software that ran a public figure did differently from this project's trainer, where
the model's numbers depend on it. A public figure is modelled as the software of its date ran it
(recipes/report/perf_figures.toml `stack`); every prediction of this trainer uses `THIS_TRAINER`.
Each field names the change that ended it, with its source.
"""

from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass(frozen=True)
class Stack:
    # torchtitan's selective op AC saved aten.abs (and aten.max) outputs "for low precision
    # training" until PR 820 (pytorch/torchtitan 88247277c, 2025-02-06, "this huge buffer saved
    # for backwards was holding abs(W3), where W3 is an unsharded weight tensor"): eager, abs() of
    # every Float8 cast's input, weights included, is a tensor of its own and is kept to backward;
    # compiled, only the rowwise recipe's weight abs() is (tensorwise fuses it into the amax).
    sac_saves_abs: bool = False
    # FSDP2 kept the root module's parameters gathered from forward to backward whatever its
    # reshard_after_forward said ("we assumed root model will be used in backward immediately")
    # until pytorch/pytorch PR 154704 (June 2025, torch 2.8): torchtitan's embedding, final norm
    # and output stayed gathered through the loss in every run before it.
    root_kept_gathered: bool = False
    # torchtitan compiles the loss with the model when training.compile is on, from PR 1033
    # (pytorch/torchtitan, merged 2025-04: "the loss fn builder has only 1 responsibility of
    # compiling the loss fn if job_config.training.compile is set"); its model returns bf16
    # logits (the .float() moved into the loss), so a fused cross-entropy reads them in place.
    loss_compiled: bool = False
    # torchtitan ran torch's default AdamW kernels, foreach on CUDA (PR 355's `optimizer.fused`
    # defaulted to false), until PR 881 (pytorch/torchtitan 6e4988550, 2025-02-24, "use Fused
    # AdamW as default"). A config setting, so applied to the run's config unless the run names
    # its implementation (`config_settings`).
    adamw_foreach: bool = False
    # Eager RMSNorm as one fused kernel: torch's nn.RMSNorm (torchtitan's norm from PR 985,
    # 2025-03-19) dispatches to aten::_fused_rms_norm on CUDA from pytorch/pytorch PR 153666 (in
    # nightlies from about 2025-08-03, in torch 2.9.0): it reads its input and writes its output
    # once, where the composite upcasts, squares, averages and scales in separate passes. This
    # trainer's RMSNorm is the composite one (core/models/llama3.py).
    fused_rms_norm: bool = False
    # SDPA runs cuDNN's attention on Hopper: torch's default there from pytorch/pytorch PR 128888
    # (nightlies from July 2024, torch 2.5.0) until PR 138522 made it opt-in (2024-10-22, torch
    # 2.5.1), and again from torch 2.11 (its bundled cuDNN passes 9.15.0: core/dryrun/software.py);
    # torchtitan forced flash attention first on H100 from 2025-05-14 (3b85aa31f) and put cuDNN
    # first on every GPU from PR 1776 (2025-10-09).
    cudnn_attention: bool = False
    # Selective op AC does not save cuDNN attention's output (the save list names only the flash
    # and efficient kernels), so its forward runs again in backward: torchtitan until PR 2095
    # (2025-12-01) added _scaled_dot_product_cudnn_attention to it.
    sac_recomputes_attention: bool = False
    # torchtitan's Llama 3 configs compute the output projection and the loss in chunks of the
    # sequence, each chunk's backward right after its forward (ChunkedLossWrapper, num_chunks 8,
    # torchtitan PR 3779, 2026-06-26): one chunk's logits at a time, and the hidden states'
    # gradient gathered in an fp32 [T, D] buffer (its GradAccumulator). 0: not chunked.
    loss_chunks: int = 0


# This trainer at its pinned torch (core/versions.py, 2.13): SDPA picks cuDNN's attention on
# Hopper and Blackwell (core/dryrun/software.py `_sdpa_prefers_cudnn`); the rest is its own.
THIS_TRAINER = Stack(cudnn_attention=True)


def stack_of(table: dict) -> Stack:
    """A Stack from a figure's `stack` table; ValueError naming an unknown field."""
    known = {f.name for f in fields(Stack)}
    unknown = sorted(set(table) - known)
    if unknown:
        raise ValueError(f"stack.{unknown[0]}: not a field of core/dryrun/stack.py Stack ({', '.join(sorted(known))})")
    return Stack(**table)


def config_settings(stack: dict, overrides: list[str] | tuple[str, ...] = ()) -> list[str]:
    """A run's settings (`--set` form), after those in which the stack's software's defaults differ
    from this trainer's: the AdamW kernels of torchtitan before PR 881, unless the run names one."""
    names = {o.split("=", 1)[0] for o in overrides}
    if stack.get("adamw_foreach") and "optimizer.implementation" not in names:
        return ['optimizer.implementation="foreach"', *overrides]
    return list(overrides)
