"""Optimizer, LR schedule (linear warmup, then decay) and grad-norm clipping for sharded params."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from core.config import JobConfig

# optimizer.implementation -> Adam(W)'s kwargs. fused: one kernel for the whole update (CPU and
# CUDA); foreach: a few kernels per op over all tensors; for-loop: one tensor at a time.
ADAM_KERNELS = {"fused": {"fused": True}, "foreach": {"foreach": True}, "for-loop": {"foreach": False}}


def build_optimizer(model_parts: list[nn.Module], cfg: JobConfig) -> torch.optim.Optimizer:
    o = cfg.optimizer
    params = [p for m in model_parts for p in m.parameters() if p.requires_grad]
    if o.name == "SGD":
        return torch.optim.SGD(params, lr=o.lr, weight_decay=o.weight_decay)
    cls = torch.optim.AdamW if o.name == "AdamW" else torch.optim.Adam
    return cls(
        params,
        lr=o.lr,
        betas=(o.beta1, o.beta2),
        eps=o.eps,
        weight_decay=o.weight_decay,
        **ADAM_KERNELS[o.implementation],
    )


def follow_settings(optimizer: torch.optim.Optimizer, scheduler, cfg: JobConfig) -> float:
    """After a resume: the optimizer's hyperparameters and the LR schedule are this run's (a
    checkpoint restores the saved run's: its lr, and the lr its schedule had reached, 0 at the end
    of a finished run), at the step reached, as an uninterrupted run with this config has them.
    The optimizer's moments stay the checkpoint's. Returns the lr of the next step."""
    o = cfg.optimizer
    settings = {"lr": o.lr, "weight_decay": o.weight_decay}
    if o.name != "SGD":
        settings |= {"betas": (o.beta1, o.beta2), "eps": o.eps}
    step = scheduler.last_epoch  # scheduler steps taken: one per optimizer step
    factor = scheduler.lr_lambdas[0](step)
    for group in optimizer.param_groups:
        group.update(settings)
        group["initial_lr"] = o.lr
        group["lr"] = o.lr * factor
    scheduler.base_lrs = [o.lr] * len(optimizer.param_groups)
    return o.lr * factor


def lr_factor(step: int, warmup: int, total: int, decay: str, min_factor: float) -> float:
    """LR multiplier at scheduler step `step` (0-based): linear warmup, then decay to min."""
    if warmup and step < warmup:
        return (step + 1) / (warmup + 1)  # never exactly 0: the first step still learns
    if decay == "none" or total <= warmup:
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    shape = 1.0 - progress if decay == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
    return min_factor + (1.0 - min_factor) * shape


def build_lr_scheduler(optimizer: torch.optim.Optimizer, cfg: JobConfig):
    s, total = cfg.lr_scheduler, cfg.training.steps
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(step, s.warmup_steps, total, s.decay_type, s.min_lr_factor)
    )


@torch.no_grad()
def clip_grad_norm_(parameters, max_norm: float, pp_group=None) -> torch.Tensor:
    """Total L2 norm over every shard on every rank, then clip.

    DTensor grads (FSDP/TP) make `get_total_norm` a DTensor whose full value is the global
    norm; pipeline stages hold disjoint parameters, so their squared norms are summed over pp.
    """
    params = [p for p in parameters if p.grad is not None]
    grads = [p.grad for p in params]
    total = torch.nn.utils.get_total_norm(grads, norm_type=2.0, foreach=True)
    if isinstance(total, DTensor):
        total = total.full_tensor()
    if pp_group is not None:
        total = total**2
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=pp_group)
        total = total**0.5
    if max_norm > 0:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total, foreach=True)
    return total
