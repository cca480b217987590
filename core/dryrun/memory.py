"""Dry-run memory accounting: the peak per rank from the model's shapes and the layout.

A timeline of the step (forward of each layer, loss, backward of each layer, optimizer; with PP
each action of the rank's schedule table), each term named: sharded fp32 parameters, gradients,
AdamW's two fp32 states, FSDP's unsharded bf16/float8 parameters in flight (and, with PP, kept
across microbatches), unsharded gradient buffers (fp32 accumulation under PP), saved activations
and the working sets of a block and of the loss (per AC mode, Float8, TP/SP and CP: computed in
core/dryrun/activations.py), the PP microbatches in flight. Under PP, what
torch.distributed.pipelining holds (`pp_buffers`): a receive buffer per microbatch for
activations and for gradients, and on the last stage every microbatch's fp32 logits, kept in
`output_chunks` for the merged return. It runs no torch ops, so the layout advisor can use it
for many candidates. Zero-bubble schedules are approximated: their I action frees what the W
action would.

Peak *reserved* memory on CUDA (the paper's figure) is the allocator's peak allocation plus what
the caching allocator holds but does not use: one stated term, `ALLOCATOR_GAP_GIB`, the same for
every row (see its comment), capped by the GPU's capacity. NCCL's own buffers are outside
PyTorch's allocator and so not in "reserved".
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from core.dryrun import adamw
from core.dryrun.activations import Shapes, chunked, head_memory, layer_memory, microbatches, shapes
from core.dryrun.linears import float8_memory, fp8_all_gather
from core.dryrun.stack import THIS_TRAINER, Stack
from core.models.args import model_args
from core.parallel.reshard import reshard_after_forward
from core.parallel.stages import plan_stages, stage_ids_for_rank, stages_per_rank

GIB = 2**30

# Peak reserved minus peak allocated of PyTorch's CUDA caching allocator: freed blocks stay
# cached, split blocks strand their tails, and the large transient allocations late in a step
# (the loss, a block's recompute) need fresh segments. torchtitan measured it for FSDP2 on
# 8 H100s (pytorch/torchtitan PR 165, Llama 7B-class, local batch 8 x 2048, bf16 + fp32
# reduce): 8.3 GiB with full AC (peak active 22.7 GiB), 9.9 GiB with selective AC (49.5 GiB)
# -- a near-constant gap, not a ratio (36% vs 20%). We add their mean to every row: stated
# once, taken from outside this project's rows, never fitted to them.
ALLOCATOR_GAP_GIB = 9.1
# The same measurements bound the gap by the allocation it serves: 8.3 GiB over 22.7 GiB active
# (full AC) is the largest share measured, 0.37 of it. A small step (a proxy, a debug model of a
# few MiB) does not strand 9 GiB: its gap is at most that share of what it allocates.
ALLOCATOR_GAP_MAX_SHARE = 8.3 / 22.7
# The paper's GPUs: H100 96 GB HBM2e, of which PyTorch can reserve about 95 GiB; the allocator
# frees its cache and retries rather than reserve past it.
PAPER_GPU_GIB = 95.0


# =============================================================================================
# Parameters per stage
# =============================================================================================
@dataclass
class StageParams:
    layers: int
    first: bool
    last: bool
    block: int  # parameters of one block held by this TP rank
    block_linear: int  # of which in linears (float8-able)
    root: int  # embedding and/or norm + output held by this TP rank
    total: int  # everything the stage holds on this TP rank
    largest: int  # its largest parameter tensor on this TP rank (the for-loop optimizer's temporaries)


def stage_params(args, layers: int, first: bool, last: bool, tp: int) -> StageParams:
    d, hd = args.dim, args.head_dim
    linear = (2 * d * args.n_heads * hd + 2 * d * args.n_kv_heads * hd + 3 * d * args.ffn_hidden_dim) // tp
    block = linear + 2 * d  # RMSNorm weights are replicated over TP
    root = (args.vocab_size * d // tp if first else 0) + ((args.vocab_size * d // tp + d) if last else 0)
    largest = max(args.vocab_size * d // tp if first or last else 0, args.ffn_hidden_dim * d // tp)
    return StageParams(layers, first, last, block, linear, root, layers * block + root, largest)


def rank_stages(cfg) -> list[list[tuple[int, list[int]]]]:
    """Per pp rank: [(stage index, layer ids), ...] as build_pipeline places them."""
    p = cfg.parallelism
    n_layers = model_args(cfg, None).n_layers
    if p.pp == 1:
        return [[(0, list(range(n_layers)))]]
    plan = plan_stages(cfg, n_layers)
    return [[(sid, plan[sid]) for sid in stage_ids_for_rank(r, p.pp, len(plan), p.pp_schedule)] for r in range(p.pp)]


# =============================================================================================
# The timeline
# =============================================================================================
CATEGORIES = (
    "params",
    "grads",
    "optimizer",
    "fsdp_unsharded_params",
    "grad_buffers",
    "pp_buffers",
    "activations",
    "working_set",
)


class _Timeline:
    """Running memory by category; `peak(label, **transient)` records a candidate peak."""

    def __init__(self):
        self.cur = {c: 0.0 for c in CATEGORIES}
        self.best = -1.0
        self.best_parts: dict[str, float] = {}
        self.best_label = ""

    def add(self, **delta):
        for k, v in delta.items():
            self.cur[k] += v

    def peak(self, label: str, **transient):
        parts = dict(self.cur)
        for k, v in transient.items():
            parts[k] += v
        total = sum(parts.values())
        if total > self.best:
            self.best, self.best_parts, self.best_label = total, parts, label


def _unsharded_block_bytes(cfg, stage: StageParams) -> float:
    """One block's parameters all-gathered for compute: bf16 (or fp32), float8 linears with
    float8 all-gather."""
    act = 2 if cfg.training.mixed_precision_param == "bfloat16" else 4
    f8 = fp8_all_gather(cfg)
    return stage.block_linear * (1 if f8 else act) + (stage.block - stage.block_linear) * act


def _grad_bytes(cfg) -> tuple[int, int]:
    """(bytes of a gradient as computed, bytes of the reduce / accumulation dtype)."""
    t = cfg.training
    comp = 2 if t.mixed_precision_param == "bfloat16" else 4
    red = 2 if t.mixed_precision_reduce == "bfloat16" else 4
    return comp, red


def _reshard(cfg, stage: StageParams, stack: Stack, fsdp: bool) -> tuple[list[bool], bool]:
    """Without PP: whether each block's and the root's compute copy of its parameters is freed
    after forward. With FSDP, its reshard policy (core/parallel/reshard.py; torch before
    pytorch#154704 kept the root gathered whatever it was asked, `stack`). Without FSDP the copy
    is autocast's bf16 cast, which each matmul saves for backward unless the block recomputes
    (without AC: kept to backward, eager and compiled alike; measured, tests/test_estimate.py)."""
    if not fsdp:
        kept = cfg.activation_checkpoint.mode == "none"
        return [not kept] * stage.layers, not kept
    blocks, root = reshard_after_forward(cfg.parallelism.fsdp_reshard_after_forward, stage.layers, False)
    return blocks, root and not stack.root_kept_gathered


def _simulate_flat(
    cfg, stage: StageParams, lm: dict, hm: dict, shard: int, fsdp: bool, stack: Stack = THIS_TRAINER
) -> _Timeline:
    """No pipeline: forward of every block, loss, backward of every block, optimizer. A block
    FSDP reshards after forward is gathered for its forward (the next one prefetched) and again
    for its backward; one it keeps stays gathered in between (core/parallel/reshard.py)."""
    tl = _Timeline()
    n = stage.total
    tl.add(params=4 * n / shard, optimizer=8 * n / shard)
    act = 2 if cfg.training.mixed_precision_param == "bfloat16" else 4
    comp, red = _grad_bytes(cfg)
    blk = _unsharded_block_bytes(cfg, stage)
    root = stage.root * act
    # Without FSDP nothing is gathered: the "sharded" copy is the only one (compute casts are
    # transient under autocast and counted with the working set).
    if not fsdp:
        blk, root = stage.block * act, stage.root * act
    L = stage.layers
    resharded, root_resharded = _reshard(cfg, stage, stack, fsdp)
    for step in range(max(1, cfg.training.grad_accum_steps)):
        kept = 0  # blocks that keep their gathered parameters from forward to backward
        for i in range(L):
            tl.add(activations=lm["saved"])
            here = blk * (1 + (i + 1 < L) + kept) + root  # this block, the next one prefetched, the root
            tl.peak(f"forward layer {i}", fsdp_unsharded_params=here, working_set=lm["fwd_work"])
            kept += not resharded[i]
        held = blk * kept + (0 if root_resharded else root)  # after the root's forward
        tl.add(activations=hm["saved"])
        tl.peak("loss forward", fsdp_unsharded_params=held, working_set=hm["loss_fwd_work"])
        tl.peak("loss backward", fsdp_unsharded_params=held, working_set=hm["loss_bwd_work"])
        tl.add(activations=-hm["saved"])
        tl.peak(
            "output backward",
            fsdp_unsharded_params=blk * kept + root,
            working_set=hm["logits_grad"] + hm["norm_saved"],
            grad_buffers=comp * stage.root,
        )
        for i in reversed(range(L)):
            kept -= not resharded[i]  # the blocks before this one that stayed gathered
            prefetched = i > 0 and resharded[i - 1]
            # The block's gradients as computed, then cast to the reduce dtype for reduce-scatter.
            bufs = stage.block * (comp + (red if red != comp or fsdp else 0))
            tl.peak(
                f"backward layer {i}",
                fsdp_unsharded_params=blk * (1 + prefetched + kept) + root,
                working_set=lm["bwd_work"],
                grad_buffers=bufs,
            )
            tl.add(activations=-lm["saved"])
            if step == 0:
                tl.add(grads=4 * stage.block / shard)
        if step == 0:
            tl.add(grads=4 * stage.root / shard)
    tl.peak(
        "optimizer step",
        working_set=adamw.temporary_bytes(cfg.optimizer.implementation, n / shard, stage.largest / shard),
    )
    return tl


def _simulate_pipeline(
    cfg, stages: list[tuple[int, StageParams]], actions: list, lm: dict, hm: dict, s: Shapes, shard: int, n_micro: int
) -> _Timeline:
    """One pp rank: its stages' actions in the schedule's order. FSDP keeps every block of a
    stage gathered from its first forward to the end of the step (no reshard between
    microbatches) and accumulates unsharded gradients in the reduce dtype (no sync until the last
    microbatch): torch.distributed.pipelining's FSDP handling."""
    tl = _Timeline()
    act = s.act
    comp, red = _grad_bytes(cfg)
    by_id = dict(stages)
    total = sum(stage.total for stage in by_id.values())
    tl.add(params=4 * total / shard, optimizer=8 * total / shard)
    gathered, accumulating = set(), set()
    io = s.tokens * s.sp * act * s.d  # a stage's input / output hidden states
    # torch.distributed.pipelining keeps one receive buffer per microbatch for the activations a
    # stage receives and for the gradients it receives; a stage input lives in its buffer.
    for stage in by_id.values():
        tl.add(pp_buffers=n_micro * io * ((not stage.first) + (not stage.last)))
    # The last stage appends each microbatch's output -- the fp32 logits -- to `output_chunks`,
    # which `step()` merges and returns (the trainer leaves return_outputs True): every
    # microbatch's logits stay from its forward until the next step clears them.
    logits = hm["logits"]

    def block_saved(stage, j):  # a non-first stage's first block saves its input: the receive buffer
        return lm["saved"] - (lm["input_saved"] if j == 0 and not stage.first else 0.0)

    for a in actions:
        kind, sid, m = a.computation_type.value, a.stage_index, a.microbatch_index
        stage = by_id[sid]
        head = hm["saved"] if stage.last else io  # the head's saved tensors, or the stage output
        if kind == "F":
            if sid not in gathered:
                gathered.add(sid)
                tl.add(fsdp_unsharded_params=stage.layers * _unsharded_block_bytes(cfg, stage) + stage.root * act)
            tl.add(activations=sum(block_saved(stage, j) for j in range(stage.layers)) + head)
            work = lm["fwd_work"]
            if stage.last:
                tl.add(pp_buffers=logits)
                work = max(work, hm["loss_fwd_work"] - logits)  # the logits are counted just above
            tl.peak(f"F stage {sid} mb {m}", working_set=work)
        elif kind in ("B", "I"):
            # Backward from the stage output down. The first microbatch's backward allocates the
            # fp32 accumulation buffers block by block (FSDP's post-backward), as the blocks free
            # that microbatch's activations.
            first = sid not in accumulating
            accumulating.add(sid)
            if first:
                tl.add(grad_buffers=stage.root * red)
            if stage.last:  # the loss's saved tensors go once its backward ran
                tl.peak(f"B stage {sid} mb {m} loss", working_set=hm["loss_bwd_work"])
                tl.add(activations=-head)
            for j in reversed(range(stage.layers)):
                tl.peak(f"B stage {sid} mb {m} block {j}", working_set=lm["bwd_work"] + comp * stage.block)
                if first:
                    tl.add(grad_buffers=stage.block * red)
                tl.add(activations=-block_saved(stage, j))
            if not stage.last:  # backward_one_chunk holds the stage output until it returns
                tl.add(activations=-head)
    # perform_reduce_grad: reduce-scatter the accumulated gradients, reshard.
    for sid, stage in stages:
        tl.peak(f"reduce grads stage {sid}", working_set=stage.block * red)
        tl.add(
            grad_buffers=-stage.total * red,
            grads=4 * stage.total / shard,
            fsdp_unsharded_params=-(stage.layers * _unsharded_block_bytes(cfg, stage) + stage.root * act),
        )
    if any(stage.last for stage in by_id.values()):
        tl.peak("merge outputs", working_set=n_micro * logits)  # step()'s torch.cat of output_chunks
    tl.peak(
        "optimizer step",
        working_set=adamw.temporary_bytes(
            cfg.optimizer.implementation, total / shard, max(st.largest for st in by_id.values()) / shard
        ),
    )
    return tl


def reserved(allocated_gib: float, gpu_gib: float = PAPER_GPU_GIB) -> float:
    """Peak reserved from peak allocated: + ALLOCATOR_GAP_GIB (at most ALLOCATOR_GAP_MAX_SHARE of
    the allocation), at most the GPU's capacity (but never less than what is allocated: above
    capacity the run does not fit)."""
    return max(allocated_gib, min(allocated_gib + allocator_gap(allocated_gib), gpu_gib))


def allocator_gap(allocated_gib: float) -> float:
    """GiB the caching allocator holds beyond a peak allocation of `allocated_gib`."""
    return min(ALLOCATOR_GAP_GIB, ALLOCATOR_GAP_MAX_SHARE * allocated_gib)


@functools.lru_cache(maxsize=256)
def schedule_table(schedule: str, pp: int, n_micro: int, spr: int) -> list[list]:
    """The schedule's own action table per rank (cached: the layout advisor asks for the same
    ones often; the performance model reads the same tables)."""
    from core.parallel.schedule_sim import pipeline_order  # local: torch, needed only with pp > 1

    return pipeline_order(schedule, pp, n_micro, spr)


def estimate_memory(cfg, gpu_gib: float = PAPER_GPU_GIB, stack: Stack = THIS_TRAINER) -> dict:
    """Accounting of the peak memory per rank (GiB): the worst rank's breakdown at its peak;
    `stack`: the software that ran it, where it differs from this trainer (core/dryrun/stack.py)."""
    from core.parallel.mesh import ParallelDims  # local: keeps `import core.dryrun.memory` torch-free

    args = model_args(cfg, None)
    p = cfg.parallelism
    dims = ParallelDims.from_config(p)
    s = shapes(cfg)
    lm = layer_memory(cfg, s, float8_memory(cfg, s, stack))
    hm = chunked(head_memory(cfg, s, stack.loss_compiled and cfg.compile.enabled), stack.loss_chunks, s)
    shard = p.dp_shard * p.cp if dims.fsdp_enabled else 1
    placement = rank_stages(cfg)
    n_stages = sum(len(r) for r in placement)
    per_rank = []
    if p.pp == 1:
        stage = stage_params(args, args.n_layers, True, True, p.tp)
        per_rank.append(_simulate_flat(cfg, stage, lm, hm, shard, dims.fsdp_enabled, stack))
    else:
        n_micro = microbatches(cfg)
        table = schedule_table(p.pp_schedule, p.pp, n_micro, stages_per_rank(p, args.n_layers))
        for r, placed in enumerate(placement):
            stages = [
                (sid, stage_params(args, len(layers), sid == 0, sid == n_stages - 1, p.tp)) for sid, layers in placed
            ]
            per_rank.append(_simulate_pipeline(cfg, stages, table[r], lm, hm, s, shard, n_micro))
    worst = max(range(len(per_rank)), key=lambda r: per_rank[r].best)
    tl = per_rank[worst]
    allocated = tl.best / GIB
    breakdown = {k: v / GIB for k, v in tl.best_parts.items()}
    breakdown["allocator_cache"] = reserved(allocated, gpu_gib) - allocated
    return {
        "estimated_peak_gib": reserved(allocated, gpu_gib),
        "allocated_peak_gib": allocated,
        "breakdown": breakdown,
        "peak_at": tl.best_label,
        "worst_pp_rank": worst,
        "per_pp_rank_allocated_gib": [t.best / GIB for t in per_rank],
        "layer_saved_gib": lm["saved"] / GIB,
        "layer_saved_parts_gib": {k: v / GIB for k, v in lm["saved_parts"].items()},
        "microbatch_tokens_per_rank": s.tokens,
        "fsdp_shard_degree": shard,
    }


# What a CPU proxy rank holds besides the accounting's tensors: the interpreter, torch and the
# trainer's imports, gloo, the data loader. Measured, not fitted to a figure judged here: peak RSS
# 0.69 GiB of a Table 1 proxy rank (debug flavor) whose accounting is 0.13 GiB.
PROXY_RANK_BASE_GIB = 0.6


def proxy_host_gib(cfg) -> tuple[float, float]:
    """(GiB one proxy rank needs at its peak, GiB the whole launch needs): the accounting's
    allocated peak of the worst rank, without a CUDA allocator's cache, plus a process's base."""
    per_rank = estimate_memory(cfg, gpu_gib=float("inf"))["allocated_peak_gib"] + PROXY_RANK_BASE_GIB
    return per_rank, per_rank * cfg.parallelism.world_size
