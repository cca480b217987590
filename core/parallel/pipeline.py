"""Pipeline parallelism with `torch.distributed.pipelining`: split, per-stage parallelize, schedule.

The whole model is cut into `pp x stages_per_rank` stages of consecutive blocks. Each stage is a
deep copy of the model with the other blocks deleted (and `tok_embeddings` / `norm` / `output`
set to None where they do not belong), so parameter names stay those of the whole model and
checkpoints line up across layouts. Each stage module then gets the same treatment as a whole
model (`parallelize`: TP -> float8 -> AC -> compile -> FSDP2) and becomes a `PipelineStage`.
Stages are placed on pp ranks round-robin ("loop": rank r holds r, r + pp, ...) or, for the
V-shaped schedules (ZBVZeroBubble, DualPipeV), as a V (rank r holds r and 2 pp - 1 - r), as
the library's own stage-to-rank mapping expects. That arithmetic (split, placement, microbatches)
lives in `core.parallel.stages`, without torch, where the config's checks and the dry-run read it.

Gradient scale: each microbatch's loss is its mean loss divided by the microbatch count and by
the gradient accumulation steps (as torchtitan does), and the schedule is built with
`scale_grads=False`: torch 2.13's `scale_grads=True` divides every accumulated `.grad` after each
`step()`, so under accumulation the earlier microsteps would be divided again. The gradients then
equal those of one pass over the whole batch of the optimizer step, under every schedule.

Shapes (`parallelism.pp_static_shapes`): by default torch 2.13 infers what crosses each stage
boundary at the first step, running a forward and backward of every stage in pipeline order (each
rank waits in `recv_object_list` for the previous one). With the option, each stage is built with
example inputs and outputs on the meta device, computed from the config (`stage_examples`), and the
inference is skipped. Under FSDP2's bf16 policy the stages exchange bf16 hidden states; under
autocast (bf16 without FSDP) and fp32 the residual stream stays fp32; the logits are fp32 (the
model upcasts them), a vocabulary-sharded DTensor under loss parallel.

A schedule's action table, and running it to find its bubble, live in `core.parallel.schedule_sim`.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining import schedules as S
from torch.distributed.pipelining.schedules import PipelineScheduleSingle, get_schedule_class
from torch.distributed.tensor import DTensor, Shard

from core.config import ConfigError, JobConfig
from core.parallel.stages import (
    PP_SCHEDULES,
    StageShapes,
    plan_stages,
    pp_microbatches,
    stage_ids_for_rank,
    static_stage_shapes,
)


# ------------------------------------------------------------------------------------ schedules
def library_schedules() -> dict[str, type]:
    """Every schedule the installed torch exports, by the name `get_schedule_class` takes."""
    out = {}
    for attr in S.__all__:
        if attr.startswith("Schedule"):
            out[attr[len("Schedule") :]] = getattr(S, attr)
    return out


def schedule_class(name: str) -> type:
    """The schedule class for a config name; ConfigError listing the valid names otherwise."""
    if name not in PP_SCHEDULES:
        raise ConfigError(f"parallelism.pp_schedule: {name!r} is not one of: {', '.join(PP_SCHEDULES)}")
    try:
        return get_schedule_class(name)
    except ValueError:
        raise ConfigError(
            f"parallelism.pp_schedule: {name!r} is not offered by torch {torch.__version__} "
            f"(it offers: {', '.join(library_schedules())})"
        ) from None


# ------------------------------------------------------------------------------------ splitting
def stage_module(model: nn.Module, stage_id: int, layers: list[int], n_stages: int) -> nn.Module:
    """A deep copy of `model` holding only `layers` (FQNs unchanged)."""
    part = copy.deepcopy(model)
    keep = {str(i) for i in layers}
    for key in list(part.layers.keys()):
        if key not in keep:
            del part.layers[key]
    if stage_id != 0:
        part.tok_embeddings = None
    if stage_id != n_stages - 1:
        part.norm = None
        part.output = None
    return part


def _autocast_forward(module: nn.Module, device_type: str) -> None:
    """bf16 compute for a stage without FSDP (nothing else casts): autocast its forward only.

    The schedule computes the loss and runs backward outside the module, as the non-pipelined
    loop does outside its autocast region. An instance attribute keeps the FQNs unchanged.
    """
    forward = module.forward
    module.forward = torch.autocast(device_type, dtype=torch.bfloat16)(forward)


# -------------------------------------------------------------------------------- static shapes
def activation_dtype(cfg: JobConfig, dims) -> torch.dtype:
    """The dtype of the hidden states between stages: bf16 only when FSDP2 casts the parameters
    (and with them the stage's inputs); autocast leaves the residual additions in fp32."""
    bf16 = cfg.training.mixed_precision_param == "bfloat16" and dims.fsdp_enabled
    return torch.bfloat16 if bf16 else torch.float32


def stage_examples(
    stage_id: int, n_stages: int, shapes: StageShapes, dtype: torch.dtype, tp_mesh=None
) -> dict[str, tuple]:
    """PipelineStage's example arguments of one stage (input_args, output_args, input_grads,
    output_grads), meta tensors that allocate nothing. The gradients are given too: torch needs
    them whenever a stage's output is a DTensor (the logits under loss parallel)."""
    meta = torch.device("meta")

    def hidden(requires_grad: bool = True) -> torch.Tensor:
        return torch.empty(shapes.hidden, dtype=dtype, device=meta, requires_grad=requires_grad)

    first, last = stage_id == 0, stage_id == n_stages - 1
    inputs = torch.empty(shapes.tokens, dtype=torch.int64, device=meta) if first else hidden()
    if not last:
        outputs = hidden()
    elif shapes.vocab_shards > 1:  # loss parallel: the local vocabulary shard, as a DTensor over tp
        mb, seq, vocab = shapes.logits
        local = torch.empty((mb, seq, vocab // shapes.vocab_shards), device=meta, requires_grad=True)
        outputs = DTensor.from_local(
            local, tp_mesh, [Shard(2)], run_check=False, shape=shapes.logits, stride=(seq * vocab, vocab, 1)
        )
    else:
        outputs = torch.empty(shapes.logits, device=meta, requires_grad=True)
    return {
        "input_args": (inputs,),
        "output_args": (outputs,),
        "input_grads": (None if first else hidden(False),),  # token ids have no gradient
        "output_grads": (None if last else hidden(False),),  # the loss starts the last stage's backward
    }


def _pipeline_stage(part: nn.Module, sid: int, n_stages: int, device, pp_group, examples: dict) -> PipelineStage:
    with warnings.catch_warnings():
        # (None,) output grads of the last stage, where the loss starts backward: torch warns that
        # "this is legal at pipeline boundaries" when the output is a DTensor
        warnings.filterwarnings("ignore", message=".*legal at pipeline boundaries.*", category=UserWarning)
        return PipelineStage(part, sid, n_stages, device, group=pp_group, **examples)


# ------------------------------------------------------------------------------------- building
class Pipeline(NamedTuple):
    """This rank's share of the pipeline, as build_pipeline made it (the schedule keeps its
    stages and microbatch count private: callers read them here)."""

    schedule: object
    parts: list[nn.Module]
    stages: list[PipelineStage]
    microbatches: int


def build_pipeline(
    model: nn.Module,
    mesh,
    dims,
    cfg: JobConfig,
    device: torch.device,
    loss_fn: Callable,
    toggles,
    parallelize: Callable,
) -> Pipeline:
    """Split `model` into this pp rank's stages, parallelize each, wrap them in the schedule.

    Returns the schedule, this rank's parts and stages (in stage order) and the microbatch count.
    """

    p = cfg.parallelism
    cls = schedule_class(p.pp_schedule)
    n_layers = len(model.layers)
    plan = plan_stages(cfg, n_layers)
    n_stages = len(plan)
    pp_mesh = mesh["pp"]
    pp_rank = pp_mesh.get_local_rank()
    ids = stage_ids_for_rank(pp_rank, dims.pp, n_stages, p.pp_schedule)
    bf16_autocast = cfg.training.mixed_precision_param == "bfloat16" and not dims.fsdp_enabled
    shapes = static_stage_shapes(cfg, n_layers, model.args.dim, model.args.vocab_size) if p.pp_static_shapes else None

    parts, stages = [], []
    for sid in ids:
        part = stage_module(model, sid, plan[sid], n_stages)
        part = parallelize(part, mesh, dims, cfg, toggles)
        if bf16_autocast:
            _autocast_forward(part, device.type)
        parts.append(part)
        examples = {}
        if shapes is not None:
            tp_mesh = mesh["tp"] if shapes.vocab_shards > 1 else None
            examples = stage_examples(sid, n_stages, shapes, activation_dtype(cfg, dims), tp_mesh)
        stages.append(_pipeline_stage(part, sid, n_stages, device, pp_mesh.get_group(), examples))

    micro = pp_microbatches(p, n_layers)

    def microbatch_loss(logits, labels):  # a share of the step's loss: gradients need no rescaling
        return loss_fn(logits, labels) / micro

    if issubclass(cls, PipelineScheduleSingle):
        if len(stages) != 1:
            raise ConfigError(f"parallelism.pp_stages_per_rank: {p.pp_schedule} takes 1 stage per rank")
        schedule = cls(stages[0], n_microbatches=micro, loss_fn=microbatch_loss, scale_grads=False)
    else:
        schedule = cls(stages, n_microbatches=micro, loss_fn=microbatch_loss, scale_grads=False)
    toggles.apply(f"pp:{p.pp_schedule}")
    if bf16_autocast:
        toggles.apply("pp_autocast_bf16")
    if shapes is not None:
        toggles.apply("pp_static_shapes")
    return Pipeline(schedule, parts, stages, micro)
