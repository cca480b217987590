"""Dry-run memory accounting: the peak per rank from the model's shapes and the layout.

A timeline of the step (forward of each layer, loss, backward of each layer, optimizer; with PP
each action of the rank's schedule table), each term named: sharded fp32 parameters, gradients,
AdamW's two fp32 states, FSDP's unsharded bf16/float8 parameters in flight (and, with PP, kept
across microbatches), unsharded gradient buffers (fp32 accumulation under PP), saved activations
for the AC mode (none / full / selective op or layer), the PP microbatches in flight, the working
set of one layer's recompute + backward (with Float8's transposed fp8 copies) and of the loss,
with TP/SP and CP shards. Under PP, what torch.distributed.pipelining holds (`pp_buffers`): a
receive buffer per microbatch for activations and for gradients, and on the last stage every
microbatch's fp32 logits, kept in `output_chunks` for the merged return. It runs no torch ops,
so the layout advisor can use it for many candidates. Zero-bubble schedules are approximated:
their I action frees what the W action would.

Peak *reserved* memory on CUDA (the paper's figure) is the allocator's peak allocation plus what
the caching allocator holds but does not use: one stated term, `ALLOCATOR_GAP_GIB`, the same for
every row (see its comment), capped by the GPU's capacity. NCCL's own buffers are outside
PyTorch's allocator and so not in "reserved".
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from core.models.args import model_args
from core.parallel.stages import plan_stages, pp_microbatches, stage_ids_for_rank, stages_per_rank

GIB = 2**30

# Peak reserved minus peak allocated of PyTorch's CUDA caching allocator: freed blocks stay
# cached, split blocks strand their tails, and the large transient allocations late in a step
# (the loss, a block's recompute) need fresh segments. torchtitan measured it for FSDP2 on
# 8 H100s (pytorch/torchtitan PR 165, Llama 7B-class, local batch 8 x 2048, bf16 + fp32
# reduce): 8.3 GiB with full AC (peak active 22.7 GiB), 9.9 GiB with selective AC (49.5 GiB)
# -- a near-constant gap, not a ratio (36% vs 20%). We add their mean to every row: stated
# once, taken from outside this project's rows, never fitted to them.
ALLOCATOR_GAP_GIB = 9.1
# The paper's GPUs: H100 96 GB HBM2e, of which PyTorch can reserve about 95 GiB; the allocator
# frees its cache and retries rather than reserve past it.
PAPER_GPU_GIB = 95.0
# Bytes per logit of the model's output: core/models/llama3.py returns fp32 logits, as
# torchtitan's model does (`self.output(h).float()`); tests/test_estimate.py checks the model.
MODEL_LOGITS_BYTES = 4


# =============================================================================================
# Shapes
# =============================================================================================
@dataclass(frozen=True)
class Shapes:
    """What one rank holds for one microbatch on one layer (elements, not bytes)."""

    d: int  # model dim
    q: int  # local query width  (n_heads / tp * head_dim)
    kv: int  # local key/value width (n_kv_heads / tp * head_dim)
    f: int  # local FFN hidden
    heads: int  # local query heads
    n_rep: int  # query heads per KV head
    vocab: int  # local vocabulary of the logits (vocab / tp with loss parallel)
    tokens: int  # tokens of one microbatch on this rank (after CP): mb * seq / cp
    sp: float  # fraction of those tokens a sequence-parallel region holds (1 / tp)
    cp: int
    tp: int
    act: int  # bytes of an activation element (2: bf16 compute, 4: fp32)
    lin_in: int  # bytes of a saved, TP-gathered linear input (1 with float8 TP styles)


def _args(cfg):
    return model_args(cfg, None)


def microbatches(cfg) -> int:
    p = cfg.parallelism
    return pp_microbatches(p, _args(cfg).n_layers) if p.pp > 1 else 1


def shapes(cfg) -> Shapes:
    a = _args(cfg)
    p, t = cfg.parallelism, cfg.training
    tp, cp = p.tp, p.cp
    hd = a.head_dim
    mb = t.local_batch_size // microbatches(cfg)
    vocab = a.vocab_size // tp if (tp > 1 and p.loss_parallel) else a.vocab_size
    act = 2 if t.mixed_precision_param == "bfloat16" else 4
    float8_tp = tp > 1 and cfg.float8.enabled and cfg.float8.recipe == "tensorwise"
    return Shapes(
        d=a.dim,
        q=a.n_heads // tp * hd,
        kv=a.n_kv_heads // tp * hd,
        f=a.ffn_hidden_dim // tp,
        heads=a.n_heads // tp,
        n_rep=a.n_heads // a.n_kv_heads,
        vocab=vocab,
        tokens=mb * t.seq_len // cp,
        sp=1.0 / tp if tp > 1 else 1.0,
        cp=cp,
        tp=tp,
        act=act,
        lin_in=1 if float8_tp else act,
    )


# =============================================================================================
# Activations of one transformer block (bytes for one microbatch)
# =============================================================================================
def _noac_saved(s: Shapes, compiled: bool) -> dict[str, float]:
    """What autograd keeps for backward after one block's forward, with no checkpointing.

    Eager, per the model code (core/models/llama3.py): RMSNorm keeps its fp32 upcast and its
    normalised bf16 output; the linears keep their input (under SP: the all-gathered
    full-sequence input); RoPE keeps nothing (its rotation table needs no gradient); repeat_kv
    materialises expanded k and v, which SDPA keeps with q, its output and the log-sum-exp;
    SwiGLU keeps w1's and w3's outputs, the SiLU output and the product. Compiled (inductor's min-cut
    partitioner), pointwise work is recomputed in backward: it keeps the norm inputs, the matmul
    inputs it cannot cheaply rebuild, q/k/v, attention output + LSE, and w1/w3 outputs.
    """
    T, a = s.tokens, s.act
    sp_T = T * s.sp
    kv_sdpa = s.q if s.n_rep > 1 else s.kv  # k and v as SDPA sees them (expanded to q heads)
    lin_in = s.lin_in if s.tp > 1 else a
    if compiled:
        return {
            "norm_inputs": 2 * sp_T * a * s.d + 2 * sp_T * 4,
            "linear_inputs": 2 * T * lin_in * s.d if s.tp > 1 else 0.0,
            "qkv": T * a * (s.q + 2 * s.kv),
            "attention_out": T * (a * s.q + 4 * s.heads),
            "ffn_hidden": 2 * T * a * s.f,
        }
    return {
        "norm": 2 * sp_T * (4 * s.d + a * s.d + 4),
        "linear_inputs": 2 * T * lin_in * s.d,
        "sdpa_qkv": T * a * (s.q + 2 * kv_sdpa),
        "attention_out": T * (a * s.q + 4 * s.heads),
        "ffn_hidden": 4 * T * a * s.f,  # w1 out, silu out, w3 out, product
    }


def _sac_op_saved(s: Shapes, every_other_mm: bool) -> dict[str, float]:
    """Selective op AC (core/toggles/activation_checkpoint.py SAVE_OPS): the block input, every
    matmul output (or every second one, torchtitan's variant), SDPA's outputs and, under TP, the
    reduce-scatter outputs; everything else is recomputed."""
    T, a = s.tokens, s.act
    sp_T = T * s.sp
    row_out = T * a * s.d  # wo / w2 matmul outputs (under TP: the partial sums before reduce-scatter)
    mms = [T * a * s.q, T * a * s.kv, T * a * s.kv, row_out, T * a * s.f, T * a * s.f, row_out]
    if every_other_mm:
        mms = mms[0::2]
    out = {
        "block_input": sp_T * a * s.d,
        "matmul_outputs": float(sum(mms)),
        "attention_out": T * (a * s.q + 4 * s.heads),
    }
    if s.tp > 1:
        out["reduce_scatter_outputs"] = 2 * sp_T * a * s.d
    return out


def _cp_attention_work(s: Shapes, backward: bool) -> float:
    """Extra memory of ring attention (all-gather rotation) over plain SDPA: every CP rank's k and
    v as SDPA sees them, plus fp32 buffers of the local queries' size: partial outputs and LSE
    merges in forward (3), gradients of q, k, v and the rotating k/v gradients in backward (9).
    Measured with torch's MemTracker on torch's ring attention at cp 2, 4, 8 (the gathered k/v
    grow with cp, the rest does not)."""
    if s.cp == 1:
        return 0.0
    kv_sdpa = s.q if s.n_rep > 1 else s.kv
    gathered = 2 * s.cp * s.tokens * kv_sdpa * s.act
    return gathered + (9 if backward else 3) * 4 * s.tokens * s.q


def layer_memory(cfg, s: Shapes | None = None) -> dict:
    """Saved bytes of one block after its forward (per microbatch) and the extra working set
    while one block runs forward and while it recomputes + runs backward."""
    s = s or shapes(cfg)
    ac = cfg.activation_checkpoint
    compiled = cfg.compile.enabled
    noac = _noac_saved(s, compiled)
    noac_total = sum(noac.values())
    T, a = s.tokens, s.act
    block_input = T * s.sp * a * s.d
    # Of the saved bytes, the block input itself (under PP a stage's first block saves the
    # schedule's receive buffer, which pp_buffers already counts): checkpointed blocks and
    # inductor's graphs keep it; eager autograd keeps the norm's fp32 upcast instead.
    noac_input = block_input if compiled else 0.0
    if ac.mode == "none":
        saved, input_saved = noac, noac_input
    elif ac.mode == "full":
        saved, input_saved = {"block_input": block_input}, block_input
    elif ac.selective_ac_option == "op":
        saved = _sac_op_saved(s, every_other_mm=getattr(ac, "save_every_other_mm", False))
        input_saved = block_input
    else:  # every k-th block fully checkpointed: average over the blocks
        k = int(ac.selective_ac_option)
        saved = {"block_input_or_all": ((k - 1) * noac_total + block_input) / k}
        input_saved = ((k - 1) * noac_input + block_input) / k
    saved_total = sum(saved.values())
    # Working set beyond what is saved (checked against torch's MemTracker in
    # tests/test_estimate.py). Forward, at the FFN: the all-gathered input and the partial output
    # of the row-wise projection (TP) or the block's output, and three FFN-hidden tensors (one
    # compiled: inductor fuses the SwiGLU chain); at the attention: ring attention's buffers.
    # Backward, at the FFN: the block's recomputed activations, the full-sequence output gradient
    # and two FFN-hidden gradients (one compiled); at the attention, after the FFN's activations
    # are freed: q/k/v gradients and ring attention's buffers.
    full_seq = T * a * s.d
    hidden = T * a * s.f
    kv_sdpa = s.q if s.n_rep > 1 else s.kv
    io = (2 if s.tp > 1 else 1) * full_seq
    ffn_fwd = (1 if compiled else 3) * hidden + io
    attn_fwd = io + _cp_attention_work(s, backward=False)
    recompute = max(0.0, noac_total - saved_total) if ac.mode != "none" else 0.0
    ffn_part = noac["ffn_hidden"] + (noac.get("norm", 0) + noac.get("norm_inputs", 0) + noac["linear_inputs"]) / 2
    ffn_bwd = recompute + (1 if compiled else 2) * hidden + full_seq
    if cfg.float8.enabled:
        # torchao's float8 backward: torch._scaled_mm takes row-major x column-major operands, so
        # a linear's weight gradient needs the output gradient cast to fp8 again, transposed, and
        # its fp8 input copied transposed (1 byte each); eager also holds the first cast and a
        # contiguous copy until the backward returns. The FFN's largest linear (w1 or w2):
        ffn_bwd += T * (s.d + s.f) if compiled else T * max(s.f + 3 * s.d, s.d + 3 * s.f)
    attn_bwd = (
        recompute
        - (ffn_part if recompute else 0.0)
        + full_seq
        + T * a * (s.q + 2 * kv_sdpa)
        + _cp_attention_work(s, backward=True)
    )
    if ac.mode == "none":
        ffn_fwd, attn_fwd = io, io + _cp_attention_work(s, backward=False)  # the rest is saved
    return {
        "saved": saved_total,
        "saved_parts": saved,
        "no_ac_saved": noac_total,
        "input_saved": input_saved,
        "fwd_work": max(ffn_fwd, attn_fwd),
        "bwd_work": max(ffn_bwd, attn_bwd),
    }


def head_memory(cfg, s: Shapes | None = None) -> dict:
    """The final norm + output projection + cross-entropy of the last stage (bytes per
    microbatch): what stays saved after forward and the extra working set of the loss.

    The model returns fp32 logits (MODEL_LOGITS_BYTES; its bf16 projection output is freed by
    the cast) -> log-softmax (its fp32 output is saved) -> NLL. Forward peak: logits +
    log-softmax output, 8 bytes per logit (12 with loss parallel, whose DTensor log-softmax keeps
    an fp32 shifted copy; bf16 logits would add their fp32 copy); backward: the saved output, its
    gradient and the input gradient, 12 bytes per logit (16). Measured with torch's MemTracker on
    real tensors (tests/test_estimate.py checks it; under FakeTensorMode the tracker also counts
    the global-shape tensors of DTensor's sharding propagation in the loss-parallel handlers, 8
    bytes per logit per TP rank, which no GPU holds).
    """
    s = s or shapes(cfg)
    T, a, V = s.tokens, s.act, s.vocab
    lp = 4 if (s.tp > 1 and cfg.parallelism.loss_parallel) else 0
    norm_saved = T * s.sp * (4 * s.d + a * s.d + 4) + T * a * s.d  # + the projection's input
    lsm = 4 * T * V
    logits = MODEL_LOGITS_BYTES * T * V
    fwd_peak = logits + T * V * ((4 if MODEL_LOGITS_BYTES != 4 else 0) + 4 + lp)
    bwd_peak = T * V * (4 + 4 + 4 + lp)
    return {
        "saved": norm_saved + lsm,
        "norm_saved": norm_saved,
        "log_softmax": lsm,
        "loss_fwd_work": fwd_peak - lsm,
        "loss_bwd_work": bwd_peak - lsm,
        "logits": logits,
        "logits_grad": T * V * a,
    }


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


def stage_params(args, layers: int, first: bool, last: bool, tp: int) -> StageParams:
    d, hd = args.dim, args.head_dim
    linear = (2 * d * args.n_heads * hd + 2 * d * args.n_kv_heads * hd + 3 * d * args.ffn_hidden_dim) // tp
    block = linear + 2 * d  # RMSNorm weights are replicated over TP
    root = (args.vocab_size * d // tp if first else 0) + ((args.vocab_size * d // tp + d) if last else 0)
    return StageParams(layers, first, last, block, linear, root, layers * block + root)


def rank_stages(cfg) -> list[list[tuple[int, list[int]]]]:
    """Per pp rank: [(stage index, layer ids), ...] as build_pipeline places them."""
    p = cfg.parallelism
    n_layers = _args(cfg).n_layers
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


def _unsharded_block_bytes(cfg, sp: StageParams) -> float:
    """One block's parameters all-gathered for compute: bf16 (or fp32), float8 linears with
    float8 all-gather."""
    act = 2 if cfg.training.mixed_precision_param == "bfloat16" else 4
    f8 = cfg.float8.enabled and cfg.float8.enable_fsdp_float8_all_gather
    return sp.block_linear * (1 if f8 else act) + (sp.block - sp.block_linear) * act


def _grad_bytes(cfg) -> tuple[int, int]:
    """(bytes of a gradient as computed, bytes of the reduce / accumulation dtype)."""
    t = cfg.training
    comp = 2 if t.mixed_precision_param == "bfloat16" else 4
    red = 2 if t.mixed_precision_reduce == "bfloat16" else 4
    return comp, red


def _simulate_flat(cfg, sp: StageParams, lm: dict, hm: dict, shard: int, fsdp: bool) -> _Timeline:
    """No pipeline: forward of every block, loss, backward of every block, optimizer."""
    tl = _Timeline()
    n = sp.total
    tl.add(params=4 * n / shard, optimizer=8 * n / shard)
    act = 2 if cfg.training.mixed_precision_param == "bfloat16" else 4
    comp, red = _grad_bytes(cfg)
    blk = _unsharded_block_bytes(cfg, sp)
    root = sp.root * act
    # Without FSDP nothing is gathered: the "sharded" copy is the only one (compute casts are
    # transient under autocast and counted with the working set).
    if not fsdp:
        blk, root = sp.block * act, sp.root * act
    L = sp.layers
    gathered = 2 * blk + root  # current + prefetched block, root (embedding/output)
    for step in range(max(1, cfg.training.grad_accum_steps)):
        for i in range(L):
            tl.add(activations=lm["saved"])
            tl.peak(f"forward layer {i}", fsdp_unsharded_params=gathered, working_set=lm["fwd_work"])
        # The root reshards after forward: the loss runs with only the last block kept gathered.
        tl.add(activations=hm["saved"])
        tl.peak("loss forward", fsdp_unsharded_params=blk, working_set=hm["loss_fwd_work"])
        tl.peak("loss backward", fsdp_unsharded_params=blk, working_set=hm["loss_bwd_work"])
        tl.add(activations=-hm["saved"])
        tl.peak(
            "output backward",
            fsdp_unsharded_params=blk + root,
            working_set=hm["logits_grad"] + hm["norm_saved"],
            grad_buffers=comp * sp.root,
        )
        for i in reversed(range(L)):
            # The block's gradients as computed, then cast to the reduce dtype for reduce-scatter.
            bufs = sp.block * (comp + (red if red != comp or fsdp else 0))
            tl.peak(
                f"backward layer {i}", fsdp_unsharded_params=gathered, working_set=lm["bwd_work"], grad_buffers=bufs
            )
            tl.add(activations=-lm["saved"])
            if step == 0:
                tl.add(grads=4 * sp.block / shard)
        if step == 0:
            tl.add(grads=4 * sp.root / shard)
    # AdamW (foreach): one parameter-sized fp32 temporary (sqrt of the second moment).
    tl.peak("optimizer step", working_set=4 * n / shard)
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
    total = sum(sp.total for sp in by_id.values())
    tl.add(params=4 * total / shard, optimizer=8 * total / shard)
    gathered, accumulating = set(), set()
    io = s.tokens * s.sp * act * s.d  # a stage's input / output hidden states
    # torch.distributed.pipelining keeps one receive buffer per microbatch for the activations a
    # stage receives and for the gradients it receives; a stage input lives in its buffer.
    for sp in by_id.values():
        tl.add(pp_buffers=n_micro * io * ((not sp.first) + (not sp.last)))
    # The last stage appends each microbatch's output -- the fp32 logits -- to `output_chunks`,
    # which `step()` merges and returns (the trainer leaves return_outputs True): every
    # microbatch's logits stay from its forward until the next step clears them.
    logits = hm["logits"]

    def block_saved(sp, j):  # a non-first stage's first block saves its input: the receive buffer
        return lm["saved"] - (lm["input_saved"] if j == 0 and not sp.first else 0.0)

    for a in actions:
        kind, sid, m = a.computation_type.value, a.stage_index, a.microbatch_index
        sp = by_id[sid]
        head = hm["saved"] if sp.last else io  # the head's saved tensors, or the stage output
        if kind == "F":
            if sid not in gathered:
                gathered.add(sid)
                tl.add(fsdp_unsharded_params=sp.layers * _unsharded_block_bytes(cfg, sp) + sp.root * act)
            tl.add(activations=sum(block_saved(sp, j) for j in range(sp.layers)) + head)
            work = lm["fwd_work"]
            if sp.last:
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
                tl.add(grad_buffers=sp.root * red)
            if sp.last:  # the loss's saved tensors go once its backward ran
                tl.peak(f"B stage {sid} mb {m} loss", working_set=hm["loss_bwd_work"])
                tl.add(activations=-head)
            for j in reversed(range(sp.layers)):
                tl.peak(f"B stage {sid} mb {m} block {j}", working_set=lm["bwd_work"] + comp * sp.block)
                if first:
                    tl.add(grad_buffers=sp.block * red)
                tl.add(activations=-block_saved(sp, j))
            if not sp.last:  # backward_one_chunk holds the stage output until it returns
                tl.add(activations=-head)
    # perform_reduce_grad: reduce-scatter the accumulated gradients, reshard.
    for sid, sp in stages:
        tl.peak(f"reduce grads stage {sid}", working_set=sp.block * red)
        tl.add(
            grad_buffers=-sp.total * red,
            grads=4 * sp.total / shard,
            fsdp_unsharded_params=-(sp.layers * _unsharded_block_bytes(cfg, sp) + sp.root * act),
        )
    if any(sp.last for sp in by_id.values()):
        tl.peak("merge outputs", working_set=n_micro * logits)  # step()'s torch.cat of output_chunks
    tl.peak("optimizer step", working_set=4 * total / shard)
    return tl


def reserved(allocated_gib: float, gpu_gib: float = PAPER_GPU_GIB) -> float:
    """Peak reserved from peak allocated: + ALLOCATOR_GAP_GIB, at most the GPU's capacity (but
    never less than what is allocated: above capacity the run does not fit)."""
    return max(allocated_gib, min(allocated_gib + ALLOCATOR_GAP_GIB, gpu_gib))


@functools.lru_cache(maxsize=256)
def _pipeline_order(schedule: str, pp: int, n_micro: int, spr: int):
    """The schedule's own action table (cached: the layout advisor asks for the same ones often)."""
    from core.parallel.pipeline import pipeline_order  # local: torch, needed only with pp > 1

    return pipeline_order(schedule, pp, n_micro, spr)


def estimate_memory(cfg, gpu_gib: float = PAPER_GPU_GIB) -> dict:
    """Accounting of the peak memory per rank (GiB): the worst rank's breakdown at its peak."""
    from core.parallel.mesh import ParallelDims  # local: keeps `import core.dryrun.memory` torch-free

    args = _args(cfg)
    p = cfg.parallelism
    dims = ParallelDims.from_config(p)
    s = shapes(cfg)
    lm, hm = layer_memory(cfg, s), head_memory(cfg, s)
    shard = p.dp_shard * p.cp if dims.fsdp_enabled else 1
    placement = rank_stages(cfg)
    n_stages = sum(len(r) for r in placement)
    per_rank = []
    if p.pp == 1:
        sp = stage_params(args, args.n_layers, True, True, p.tp)
        per_rank.append(_simulate_flat(cfg, sp, lm, hm, shard, dims.fsdp_enabled))
    else:
        n_micro = microbatches(cfg)
        table = _pipeline_order(p.pp_schedule, p.pp, n_micro, stages_per_rank(p, args.n_layers))
        for r, stages in enumerate(placement):
            sps = [
                (sid, stage_params(args, len(layers), sid == 0, sid == n_stages - 1, p.tp)) for sid, layers in stages
            ]
            per_rank.append(_simulate_pipeline(cfg, sps, table[r], lm, hm, s, shard, n_micro))
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
