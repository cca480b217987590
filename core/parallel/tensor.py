"""Tensor + sequence + loss parallelism (Megatron-style, on DTensor), torchtitan's Llama plan.

Between blocks the activations are sequence-sharded (`Shard(1)`): the norms run on a slice of
the sequence (SequenceParallel) and each attention / feed-forward gathers the full sequence on
entry (PrepareModuleInput Shard(1) -> Replicate), runs column-wise (wq, wk, wv, w1, w3: each rank
owns some heads / hidden units) then row-wise (wo, w2) projections, and reduce-scatters back to
Shard(1). Grouped-query attention splits query and KV heads by the same degree, so the
heads-per-KV-head ratio of a shard is the model's (core.validate checks tp divides both).

Loss parallel: the output projection keeps its vocabulary-sharded logits as a DTensor
(Shard(-1)) and the trainer computes cross-entropy under `loss_parallel()`, so the full logits
never exist on one rank.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from core.config import JobConfig


def tp_styles(model: nn.Module, cfg: JobConfig, toggles=None):
    """(colwise, rowwise, prepare_input) classes for the block linears.

    Float8 hook: with tensorwise float8, torchao's Float8 styles all-gather the sequence in
    float8 instead of the high-precision dtype. They only accept `Float8Linear` modules, so they
    are used when the linears were converted before TP runs; otherwise the plain styles are used
    (float8 conversion after TP would replace the modules and lose TP's hooks).
    """
    plain = (ColwiseParallel, RowwiseParallel, PrepareModuleInput)
    if not cfg.float8.enabled:
        return plain
    reason = None
    if cfg.float8.recipe != "tensorwise":
        reason = f"float8 TP styles support the tensorwise recipe only (recipe {cfg.float8.recipe})"
    else:
        from torchao.float8.float8_linear import Float8Linear  # local: torchao only when Float8 is on

        block = next(iter(model.layers.values()), None) if model.layers is not None else None
        if block is None or not isinstance(block.attention.wq, Float8Linear):
            reason = "linears are not Float8Linear when TP is applied (convert float8 before apply_tp)"
        elif not torch.cuda.is_available():
            # gloo has no float8 dtypes ("Invalid scalar type"); FSDP2's float8 all-gather works on
            # CPU because it sends uint8 bytes, DTensor's TP redistribute sends the float8 tensor.
            reason = "gloo (CPU) cannot all-gather float8 tensors: float8 TP all-gather needs CUDA/NCCL"
    if reason:
        if toggles is not None:
            toggles.skip("float8_tp", reason)
        return plain
    from torchao.float8.float8_tensor_parallel import (  # local: torchao only when Float8 is on
        Float8ColwiseParallel,
        Float8RowwiseParallel,
        PrepareFloat8ModuleInput,
    )

    if toggles is not None:
        toggles.apply("float8_tp")
    return Float8ColwiseParallel, Float8RowwiseParallel, PrepareFloat8ModuleInput


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, cfg: JobConfig, toggles) -> nn.Module:
    """Shard `model` (a whole Transformer or a pipeline stage of one) over `tp_mesh` in place."""
    loss_parallel = cfg.parallelism.loss_parallel
    colwise, rowwise, prepare_input = tp_styles(model, cfg, toggles)

    # Embedding, final norm and output: each may be absent on a pipeline stage (set to None).
    top = {}
    if model.tok_embeddings is not None:
        # Row-wise over the vocabulary: each rank looks up its rows, the partial sums are
        # reduce-scattered straight into the sequence-sharded layout.
        top["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))
    if model.norm is not None:
        top["norm"] = SequenceParallel()
    if model.output is not None:
        # Always the plain style: float8 is not applied to the output projection (filter_fqns).
        top["output"] = ColwiseParallel(
            input_layouts=Shard(1),
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,
        )
    if top:
        parallelize_module(model, tp_mesh, top)

    for block in model.layers.values():
        parallelize_module(
            block,
            tp_mesh,
            {
                # SequenceParallel turns the norm weights into (replicated) DTensors as well: plain
                # tensors next to DTensors would break AdamW(foreach=True) and grad clipping.
                "attention_norm": SequenceParallel(),
                "attention": prepare_input(input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)),
                "attention.wq": colwise(),
                "attention.wk": colwise(),
                "attention.wv": colwise(),
                "attention.wo": rowwise(output_layouts=Shard(1)),
                "ffn_norm": SequenceParallel(),
                "feed_forward": prepare_input(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
                "feed_forward.w1": colwise(),
                "feed_forward.w2": rowwise(output_layouts=Shard(1)),
                "feed_forward.w3": colwise(),
            },
        )

    toggles.apply("tp")
    toggles.apply("sequence_parallel")
    if loss_parallel:
        toggles.apply("loss_parallel")
    else:
        toggles.skip("loss_parallel", "parallelism.loss_parallel = false")
    return model
