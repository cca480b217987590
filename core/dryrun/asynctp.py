"""Tensor parallelism's collectives in one block and what of them the step sees: all of each
(vanilla TP: NCCL, on the critical path between the matmuls), or what AsyncTP leaves of those it
fuses with their matmuls, as torch 2.13 runs it.

Which collectives fuse (torch/_inductor/fx_passes/micro_pipeline_tp.py, inside each compiled
block): an all-gather whose result feeds matmuls directly (`fuse_all_gather_matmul`: wq, wk and wv
share one; w1 and w3 share one; in backward the gathered output gradient of wo and of w2 feeds
its grad-input matmul), and a reduce-scatter whose input is one matmul's output
(`fuse_matmul_reduce_scatter`: wo, w2). Left alone: backward's reduce-scatters of the attention
and FFN input gradients (their input is the sum of two or three grad-input matmuls, not a matmul:
`_find_producer_matmul`), and, under the rowwise recipes, every all-gather (its result feeds the
rowwise quantization, not the matmul: `_find_consumer_matmuls`). The output projection and the
embedding are not compiled: their collectives stay NCCL's.

How a fused op runs (torch/distributed/_symmetric_memory/__init__.py):
- all-gather + matmul (`_pipelined_multi_all_gather_and_consume`): the local shard is copied into
  the symmetric buffer and a barrier passes, serially; then the own shard's matmul, while the
  shards of the other tp - 1 ranks are pulled one at a time (copies on the two streams never
  overlap), each consumed by its matmul chunk as it lands;
- matmul + reduce-scatter (`_pipelined_produce_and_all2all`): tp - 1 chunks, each computed for a
  peer, a barrier, then pulled by that peer while the next chunk computes; the own chunk last;
  then one kernel sums the tp partial results (a pass over the whole unreduced output).
The chunks are GEMMs of 1/tp of the rows (core/dryrun/gemm.py prices them at that shape); the
peer copies are copy-engine transfers over NVLink (no SMs; "[Distributed w/ TorchTitan]
Introducing Async Tensor Parallelism in PyTorch", discuss.pytorch.org/t/209487), priced at the
NVLink rate NCCL reaches, and their HBM traffic (read on one GPU, written on the other) competes
with the matmul chunk running beside them.

Sequence parallelism shards dim 1 of (batch, seq, dim) activations while NCCL gathers into and
reduce-scatters from dim 0, so torch reorders around each collective (`seq_dim_copy_seconds`):
NCCL's all-gathers copy when the batch is above 1, its reduce-scatters always (unless a sum's
kernel writes the order); the fused ops move the sequence first themselves, so AsyncTP copies
only a fused reduce-scatter's matmul input and, in backward, the gathered inputs the
grad-weight matmuls read, both only when batched.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import NamedTuple

from core.dryrun.gemm import IN_BYTES, gemm_seconds
from core.dryrun.linears import block_linears, gemm_kinds


@dataclass(frozen=True)
class Collective:
    kind: str  # "ag" or "rs"
    nbytes: float  # gathered size (all-gather) or unreduced size (reduce-scatter)
    elem_bytes: int
    matmuls: tuple  # ((linear, n, k, gemm kind), ...) fused with it under AsyncTP; () = never fused


def _mm(lin, which: int, recipe: str, grad_input: bool = False):
    kind = gemm_kinds(lin, recipe)[which]
    return (lin.name, lin.k, lin.n, kind) if grad_input else (lin.name, lin.n, lin.k, kind)


def block_collectives(s, recipe: str) -> dict[str, list[Collective]]:
    """The block's TP collectives for one microbatch: forward (also what a full recompute runs)
    and backward; each with the matmuls AsyncTP fuses it with."""
    T, d = s.tokens, s.d
    lin = {x.name: x for x in block_linears(s)}
    fp8_tp = recipe == "tensorwise"  # Float8's TP styles gather float8
    ag_fuses = recipe in ("bf16", "tensorwise")  # rowwise: the gather feeds the quantization
    act = 1 if fp8_tp else 2

    def ag(names, which=0, grad_input=False):
        mms = tuple(_mm(lin[n], which, recipe, grad_input) for n in names) if ag_fuses else ()
        return Collective("ag", T * d * act, act, mms)

    fwd = [
        ag(("wq", "wk", "wv")),
        Collective("rs", T * d * 2, 2, (_mm(lin["wo"], 0, recipe),)),
        ag(("w1", "w3")),
        Collective("rs", T * d * 2, 2, (_mm(lin["w2"], 0, recipe),)),
    ]
    bwd = [
        ag(("wo",), which=1, grad_input=True),
        ag(("w2",), which=1, grad_input=True),
        Collective("rs", T * d * 2, 2, ()),
        Collective("rs", T * d * 2, 2, ()),
    ]
    return {"fwd": fwd, "bwd": bwd}


def _fused_ag(spec, link, c: Collective, tokens: float, tp: int) -> float:
    shard = c.nbytes / tp
    copy = shard / link.bandwidth
    hbm = spec.hbm_bandwidth * spec.hbm
    chunk = sum(gemm_seconds(spec, tokens / tp, n, k, kind) for _, n, k, kind in c.matmuls)
    chunk_beside_copy = sum(
        gemm_seconds(spec, tokens / tp, n, k, kind, extra_bytes=2 * shard / len(c.matmuls))
        for _, n, k, kind in c.matmuls
    )
    serial = 2 * shard / hbm + spec.kernel_overhead_s + link.step_latency  # own shard into the buffer, barrier
    copied = 0.0
    mm_end = chunk  # the own shard's chunk, while the first peer copy runs
    for _ in range(tp - 1):
        copied += copy
        mm_end = max(mm_end, copied) + chunk_beside_copy
    return serial + mm_end + link.step_latency


def _fused_rs(spec, link, c: Collective, tokens: float, tp: int) -> float:
    (_, n, k, kind) = c.matmuls[0]
    part = tokens / tp * n * c.elem_bytes
    copy = part / link.bandwidth
    hbm = spec.hbm_bandwidth * spec.hbm
    chunk = gemm_seconds(spec, tokens / tp, n, k, kind)
    chunk_beside_copy = gemm_seconds(spec, tokens / tp, n, k, kind, extra_bytes=2 * part)
    made = copied = 0.0
    for step in range(tp - 1):
        made += chunk if step == 0 else chunk_beside_copy
        copied = max(copied, made + link.step_latency) + copy
    made += chunk_beside_copy  # the own chunk, beside the last copy
    reduce = (tokens * n + tokens / tp * n) * c.elem_bytes / hbm + spec.kernel_overhead_s
    return max(made, copied) + link.step_latency + reduce


def fused_seconds(spec, link, c: Collective, tokens: float, tp: int) -> float:
    """Seconds of a fused collective + its matmuls under AsyncTP."""
    return (_fused_ag if c.kind == "ag" else _fused_rs)(spec, link, c, tokens, tp)


def unfused_matmuls(spec, c: Collective, tokens: float) -> float:
    return sum(gemm_seconds(spec, tokens, n, k, kind) for _, n, k, kind in c.matmuls)


class TPCost(NamedTuple):
    """Seconds a block's TP collectives add beyond their matmuls' own time."""

    comm: float  # communication the step sees
    work: float  # extra compute of AsyncTP's fused ops
    copies: float  # memory-bound copies that reorder the sequence dimension


def exposed(
    spec, link, collectives: list[Collective], tokens: float, tp: int, async_tp: bool, batched: bool = False
) -> TPCost:
    """What these collectives add to the step beyond their matmuls' own time. Vanilla TP: the
    NCCL collective in full, no extra work. Fused by AsyncTP: the pipelined op's time beyond the
    unsplit matmuls, split into what it costs with free links (its extra work: the chunked
    GEMMs, the local copy, the sum of the partials) and the rest (waiting on peer copies and
    barriers). Both: the copies that reorder the sequence dimension (`seq_dim_copy_seconds`).
    `batched`: the microbatch's batch dimension is above 1."""
    comm = work = copies = 0.0
    free = dataclasses.replace(link, bandwidth=math.inf, step_latency=0.0, base_latency=0.0)
    for c in collectives:
        if async_tp and c.matmuls and not link.nodes_spanned:
            base = unfused_matmuls(spec, c, tokens)
            alone = max(base, fused_seconds(spec, free, c, tokens, tp))
            work += alone - base
            comm += max(0.0, fused_seconds(spec, link, c, tokens, tp) - alone)
            if batched and c.kind == "rs":  # the matmul's input, sequence moved first and flattened
                (_, _, k, kind) = c.matmuls[0]
                copies += seq_dim_copy_seconds(spec, tokens * k * IN_BYTES[kind])
        else:
            comm += link.ring(c.nbytes)
            if nccl_copies(c, batched):
                copies += seq_dim_copy_seconds(spec, c.nbytes)
    return TPCost(comm, work, copies)


def nccl_copies(c: Collective, batched: bool) -> bool:
    """Whether NCCL's collective over the sequence dimension copies its whole tensor: an
    all-gather when the batch is above 1 (a view otherwise), a reduce-scatter always, unless its
    input is a sum of matmuls (backward's input gradients), whose kernel writes the order the
    collective needs."""
    return batched if c.kind == "ag" else bool(c.matmuls)


def fused_gather_copies(spec, link, col: dict[str, list[Collective]], async_tp: bool, batched: bool) -> float:
    """Seconds of the copies backward makes of what AsyncTP's fused all-gathers return: the
    gathered input comes back in the sharded layout, sequence first (`unflatten` in
    `_fused_all_gather_matmul_impl`), and each grad-weight matmul needs it row-major again."""
    if not (async_tp and batched) or link.nodes_spanned:
        return 0.0
    return sum(seq_dim_copy_seconds(spec, c.nbytes) for c in col["fwd"] + col["bwd"] if c.kind == "ag" and c.matmuls)


def seq_dim_copy_seconds(spec, nbytes: float) -> float:
    """One read and one write of a tensor: NCCL gathers into and reduce-scatters from dim 0,
    while sequence parallelism shards dim 1 of (batch, seq, dim) activations, so torch reorders
    the whole tensor around the collective (torch/_utils.py `_maybe_view_chunk_cat` after an
    all-gather: a view only when the batch is 1; `_chunk_or_narrow_cat` before a reduce-scatter,
    torch/distributed/_functional_collectives.py `reduce_scatter_single`: always a `torch.cat`)."""
    return 2 * nbytes / (spec.hbm_bandwidth * spec.hbm) + spec.kernel_overhead_s
