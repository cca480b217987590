"""One rank's forward and backward of one microbatch, the same for every layout: the trainer's
step, and the dry-run's fake step runs it too. The CP context wraps both, loss parallel wraps
the loss, the pipeline schedule runs when there is one, and bf16 autocast when nothing else casts.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from core.build import BuiltModel
from core.config import JobConfig
from core.parallel.context import loss_parallel_context, step_context
from core.parallel.mesh import ParallelDims


def cross_entropy_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1))


def pipeline_loss(cfg: JobConfig) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The pipeline schedule's loss of one microbatch: scaled like the non-pipelined step's (the
    schedule divides it by its microbatch count, core/parallel/pipeline.py)."""
    accum = cfg.training.grad_accum_steps
    return lambda logits, labels: cross_entropy_loss(logits, labels) / accum


class TrainStep:
    """Forward + backward of one microbatch on this rank's model parts (or its pipeline stages)."""

    def __init__(self, cfg: JobConfig, mesh, device: torch.device, model: BuiltModel):
        self.cfg, self.mesh, self.device = cfg, mesh, device
        self.model_parts, self.pp_schedule, self.stages = model.parts, model.schedule, model.stages
        # Without FSDP nothing casts parameters for compute: bf16 runs under autocast.
        self.autocast_bf16 = (
            cfg.training.mixed_precision_param == "bfloat16"
            and not ParallelDims.from_config(cfg.parallelism).fsdp_enabled
        )

    def _autocast(self):
        return torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.autocast_bf16)

    def forward_backward(self, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        accum = self.cfg.training.grad_accum_steps
        inputs, labels = inputs.to(self.device), labels.to(self.device)
        with step_context(self.cfg, self.mesh, inputs, labels, self.model_parts):
            if self.pp_schedule is not None:
                return self._pipeline_step(inputs, labels)
            model = self.model_parts[0]
            with loss_parallel_context(self.cfg):
                with self._autocast():
                    logits = model(inputs)
                loss = cross_entropy_loss(logits, labels) / accum
                del logits
                loss.backward()
        return loss.detach()

    def _pipeline_step(self, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The schedule's step; the loss of this rank's last stage (zero on the other ranks). The
        last stage keeps no microbatch's logits (`return_outputs=False`): the losses are all the
        step reads, and at 405B every microbatch's logits would be ~16 GiB on the fullest rank."""
        losses: list[torch.Tensor] = []
        has_first = any(s.is_first for s in self.stages)
        has_last = any(s.is_last for s in self.stages)
        with loss_parallel_context(self.cfg):
            self.pp_schedule.step(
                *([inputs] if has_first else []),
                target=labels if has_last else None,
                losses=losses,
                return_outputs=False,
            )
        loss = torch.stack(losses).sum() if has_last else torch.zeros((), device=self.device)
        return loss.detach()  # each microbatch's loss was divided by the microbatches and accum
