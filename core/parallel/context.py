"""Context parallelism: ring attention over the `cp` mesh dim, on torch's public API.

`torch.distributed.tensor.experimental.context_parallel` shards the sequence-dimension buffers
(inputs, labels, the RoPE table) in place with the head-tail load balancer (rank r of c keeps
chunks r and 2c-1-r of 2c, so causal work is even), and for the duration of the context turns
`F.scaled_dot_product_attention` into ring attention (the KV shards rotated by all-gather or
all-to-all). Forward and backward both run inside the context.

Each rank then holds seq_len / cp tokens of every sequence: the mean loss of its tokens, averaged
over the cp ranks (the trainer averages over dp x cp), is the loss of the whole batch, and FSDP
averages gradients over dp_shard x cp, so no extra scaling is needed.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed.tensor.experimental._context_parallel._attention as cp_attention  # private: ring templates
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.experimental import context_parallel
from torch.distributed.tensor.experimental._attention import set_rotate_method  # private: no public switch
from torch.distributed.tensor.parallel import loss_parallel

from core.config import JobConfig
from core.parallel.mesh import WorldMesh

ROTATE_METHODS = ("allgather", "alltoall")


def cp_context(
    cp_mesh: DeviceMesh, buffers: list[torch.Tensor], seq_dims: list[int], rotate_method: str = "allgather"
) -> contextlib.AbstractContextManager:
    """A context manager to wrap forward + backward; shards `buffers` along `seq_dims` on entry
    and restores them on exit."""
    if rotate_method not in ROTATE_METHODS:
        raise ValueError(f"cp rotate method {rotate_method!r} is not one of {ROTATE_METHODS}")
    set_rotate_method(rotate_method)
    stack = contextlib.ExitStack()
    if cp_mesh.device_type == "cpu":
        stack.enter_context(_cpu_flash_attention_rule())  # must precede context_parallel's entry
    stack.enter_context(context_parallel(cp_mesh, buffers=buffers, buffer_seq_dims=seq_dims))
    return stack


def step_context(
    cfg: JobConfig, mesh: WorldMesh, inputs: torch.Tensor, labels: torch.Tensor, model_parts: list[nn.Module]
) -> contextlib.AbstractContextManager:
    """What one forward + backward runs inside: with cp > 1, the CP context sharding inputs,
    labels (sequence dim 1) and every part's RoPE table (dim 0); otherwise nothing."""
    if cfg.parallelism.cp == 1:
        return contextlib.nullcontext()
    buffers = [inputs, labels] + [m.freqs_cis for m in model_parts]
    seq_dims = [1, 1] + [0] * len(model_parts)
    return cp_context(mesh["cp"], buffers, seq_dims, cfg.parallelism.cp_rotate_method)


def loss_parallel_context(cfg: JobConfig) -> contextlib.AbstractContextManager:
    """torch's loss parallel (cross-entropy on the vocabulary-sharded logits of TP's output
    projection, no all-gather) when TP is on and parallelism.loss_parallel asks for it. The loss
    and its backward must both run inside."""
    if cfg.parallelism.tp > 1 and cfg.parallelism.loss_parallel:
        return loss_parallel()
    return contextlib.nullcontext()


# ------------------------------------------------------------------------------------ CPU shim
# Why this exists: on CPU, SDPA runs `aten._scaled_dot_product_flash_attention_for_cpu`, and
# torch 2.13's context-parallel dispatcher only knows the CUDA kernels (flash, efficient, cudnn):
# "...for_cpu.default does not have a sharding strategy registered". The CPU op has the same
# (output, logsumexp) contract as the CUDA flash kernel, so it gets the same treatment: torch's own
# ring-attention templates, called with the CPU kernels. It is registered only for the duration
# of a CPU context (nothing changes for CUDA) and uses private torch names, so a torch upgrade
# that adds the rule natively should delete it. Measured: loss within 1e-6 of a single process.


@contextlib.contextmanager
def _cpu_flash_attention_rule() -> Iterator[None]:
    aten = torch.ops.aten
    ops = {
        aten._scaled_dot_product_flash_attention_for_cpu.default: _ring_cpu_flash,
        aten._scaled_dot_product_flash_attention_for_cpu_backward.default: _ring_cpu_flash_backward,
    }
    table = cp_attention.custom_ops  # read by context_parallel when it enables its dispatcher
    added = [op for op in ops if op not in table]
    for op in added:
        table[op] = _cpu_flash_handler
    try:
        yield
    finally:
        for op in added:
            table.pop(op, None)


SEQ_DIM = 2  # q, k, v are (batch, heads, seq, head_dim) inside SDPA


def _ring_cpu_flash(mesh, query, key, value, dropout_p=0.0, is_causal=False, *, attn_mask=None, scale=None):
    if attn_mask is not None:
        raise NotImplementedError("context parallel supports causal attention without a mask")
    return cp_attention._templated_ring_attention(
        mesh.get_group(),
        SEQ_DIM,
        torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
        query,
        key,
        value,
        is_causal=is_causal,
        dropout_p=dropout_p,
        scale=scale,
    )


def _ring_cpu_flash_backward(
    mesh, grad_out, query, key, value, out, logsumexp, dropout_p, is_causal, *, attn_mask=None, scale=None
):
    if attn_mask is not None:
        raise NotImplementedError("context parallel supports causal attention without a mask")
    return cp_attention._templated_ring_attention_backward(
        mesh.get_group(),
        SEQ_DIM,
        torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
        grad_out=grad_out,
        grad_out_name="grad_out",
        query=query,
        key=key,
        value=value,
        out=out,
        logsumexp=logsumexp,
        is_causal=is_causal,
        dropout_p=dropout_p,
        scale=scale,
    )


def _cpu_flash_handler(op_call, args, kwargs):
    """DTensor custom-op handler: every tensor in and out is sequence-sharded on the cp mesh."""
    # private: DTensor's dispatcher, as torch's own CP handlers unwrap args (no public equivalent)
    info = DTensor._op_dispatcher.unwrap_to_op_info(op_call, args, kwargs)
    fn = (
        _ring_cpu_flash
        if op_call == torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
        else _ring_cpu_flash_backward
    )
    results = fn(info.compute_mesh, *info.local_args, **info.local_kwargs)
    # out, logsumexp (forward) and dq, dk, dv (backward) all keep the sequence at dim 2.
    return tuple(DTensor.from_local(t, info.compute_mesh, [Shard(SEQ_DIM)], run_check=False) for t in results)
