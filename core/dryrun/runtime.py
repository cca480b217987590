"""Dry-run performance model: the step time of a layout on a named GPU system, and from it
tokens/s per GPU and MFU, with where the time goes.

It walks the same step the memory accounting walks (core/dryrun/memory.py): forward and
backward of each block, the loss, the optimizer; under PP each rank's actions in the schedule's
own order (`core.parallel.schedule_sim.pipeline_order`). Each event gets:

- compute: every matmul (each linear's three GEMMs, TP shards included, and the output
  projection) priced by its shape and kernel family (core/dryrun/gemm.py; the Float8 recipe's
  kernels, core/dryrun/linears.py; the output projection stays BF16, as torchtitan filters it),
  causal flash-attention FLOPs at the attention rate; recompute under the AC mode (full: the
  whole block forward; selective op with every other matmul saved: wk, wo, w3 and every
  pointwise op; selective k: every k-th block);
- memory-bound work: bytes of the pointwise / norm / RoPE ops (see `_pointwise_bytes` for what
  compile fuses) and of Float8's casts per recipe (core/dryrun/linears.py) at HBM bandwidth;
- communication (core/dryrun/comms.py for the links): FSDP all-gather / reduce-scatter per block
  on a stream of its own with one block of prefetch, HSDP all-reduce, TP/SP all-gather /
  reduce-scatter around the block's matmuls (AsyncTP: what torch's micro-pipeline pass fuses
  and what its pipelined ops leave exposed, with the copies that reorder the sequence
  dimension around them, core/dryrun/asynctp.py), loss
  parallel's all-reduces, CP's ring attention as torch runs it (core/dryrun/ring.py: the k/v
  and dk/dv exchanges behind its steps, its eager fp32 merge and accumulation), PP send/recv,
  the grad-norm all-reduce; what cannot hide is exposed;
- pipeline bubbles from running the schedule's action table with these costs (the one
  list-scheduler, `core.parallel.schedule_sim.run_schedule`).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING

from core.dryrun import accuracy, adamw, ring
from core.dryrun.activations import Shapes, fused_loss, microbatches, shapes
from core.dryrun.asynctp import TPCost, block_collectives, exposed, fused_gather_copies, seq_dim_copy_seconds
from core.dryrun.comms import mesh_links
from core.dryrun.fsdp_cost import fsdp_copies, fsdp_stream, fsdp_times
from core.dryrun.gemm import gemm_seconds
from core.dryrun.gpuspec import DEFAULT_GPU, GPUSpec, load_spec

if TYPE_CHECKING:  # type names only: core.parallel imports torch, the model stays torch-free to import
    from core.config import JobConfig
    from core.models.args import ModelArgs
    from core.parallel.mesh import ParallelDims
from core.dryrun.linears import block_linear_seconds, fp8_all_gather, linear_gemm_shapes
from core.dryrun.memory import StageParams, estimate_memory, rank_stages, schedule_table, stage_params
from core.dryrun.stack import THIS_TRAINER, Stack
from core.models.args import model_args
from core.parallel.reshard import reshard_after_forward

# Flash attention's backward runs 5 matmuls to the forward's 2 (it recomputes the scores).
FLASH_BWD_OVER_FWD = 2.5


# =============================================================================================
# One block, one microbatch, one rank
# =============================================================================================
def block_flops(s: Shapes, seq_len: int) -> dict:
    """Forward FLOPs of one block: matmuls (local widths, all T tokens of the rank: SP gathers
    them), attention as flash runs it (causal: half the score matrix; CP ranks hold 1/cp of the
    queries against the whole sequence) and as torch's FLOP counter counts SDPA (dense)."""
    T, d = s.tokens, s.d
    mm = 2 * T * (2 * d * s.q + 2 * d * s.kv + 3 * d * s.f)
    dense_attn = 4 * T * seq_len * s.q
    return {"matmul": mm, "attention": dense_attn / 2, "attention_dense": dense_attn}


def analytic_flops(cfg) -> dict:
    """Matmul + attention FLOPs of one training step on one rank without PP and without AC, as
    torch.utils.flop_counter counts them (dense SDPA; matmul backward 2 x forward, SDPA backward
    2.5 x: it recomputes the scores): the check against the fake step's count."""
    s = shapes(cfg)
    a = model_args(cfg, None)
    L, seq = a.n_layers, cfg.training.seq_len
    blk = block_flops(s, seq)
    head = 2 * s.tokens * s.d * (a.vocab_size // s.tp)
    n = microbatches(cfg) * max(1, cfg.training.grad_accum_steps)
    mm = 3 * (L * blk["matmul"] + head) * n
    attn = (1 + FLASH_BWD_OVER_FWD) * L * blk["attention_dense"] * n
    return {"total": mm + attn, "matmul": mm, "attention": attn}


def _pointwise_bytes(s: Shapes, compiled: bool, fused_norm: bool = False) -> float:
    """HBM bytes of one block's forward outside the matmuls, SDPA and Float8's casts.

    Eager, per core/models/llama3.py: RMSNorm upcasts, squares, averages, scales, casts back and
    multiplies by its weight (36 bytes per element); the residual add (6); RoPE upcasts q and k,
    multiplies complex and casts back (20); repeat_kv copies k and v out to the query heads;
    SiLU then the product (10 per FFN element). Compiled, inductor fuses each run of pointwise
    and reduction ops between two extern kernels (matmul, SDPA) into one kernel that reads its
    inputs once and writes its outputs once: residual add + RMSNorm (8 bytes), RoPE on q and k
    together with repeat_kv's copy (4 + the expanded write), SiLU x mul (6). Float8's casts:
    core/dryrun/linears.py. `fused_norm` (eager): torch's fused RMSNorm kernel reads its input
    and writes its output once (4 bytes; core/dryrun/stack.py `fused_rms_norm`)."""
    T, a = s.tokens, 2
    Tsp = T * s.sp
    expand = 2 * T * (s.q - s.kv) * a if s.n_rep > 1 else 0.0
    if compiled:
        return 2 * 8 * Tsp * s.d + 4 * T * (s.q + s.kv) + expand + 6 * T * s.f
    norm = 4 if fused_norm else 36
    return 2 * norm * Tsp * s.d + 2 * 6 * Tsp * s.d + 20 * T * (s.q + s.kv) + expand + 2 * expand + 10 * T * s.f


class _Rates:
    def __init__(self, spec: GPUSpec, cudnn_attention: bool = False):
        clk = spec.clock_fraction
        # cuDNN's attention where the software runs it and the spec has its rates, else flash's
        cudnn = cudnn_attention and spec.cudnn_attention_fwd > 0
        fwd, bwd = (spec.cudnn_attention_fwd, spec.cudnn_attention_bwd) if cudnn else (0.0, 0.0)
        self.attn_f = spec.peak_bf16_flops * (fwd or spec.flash_attention_fwd) * clk
        self.attn_b = spec.peak_bf16_flops * (bwd or spec.flash_attention_bwd) * clk
        self.hbm = spec.hbm_bandwidth * spec.hbm


def _batched(cfg) -> bool:
    """The microbatch has a batch dimension above 1: sequence parallelism's all-gathers then
    reorder what they gather (core/dryrun/asynctp.py `seq_dim_copy_seconds`)."""
    return cfg.training.local_batch_size // microbatches(cfg) > 1


def _sp_copy(cfg, s: Shapes, spec: GPUSpec, kind: str) -> float:
    """Seconds of the copy an NCCL sequence-parallel collective (`ag` or `rs`) of a (T x dim)
    bf16 activation outside the blocks makes: an all-gather's when batched, a reduce-scatter's
    always (none of them reduces a sum of matmuls; core/dryrun/asynctp.py `nccl_copies`)."""
    copies = s.tp > 1 and (kind == "rs" or _batched(cfg))
    return seq_dim_copy_seconds(spec, s.tokens * s.d * 2) if copies else 0.0


def _tp_seconds(cfg, s: Shapes, spec: GPUSpec, link, recipe: str, recomputed: tuple) -> dict:
    """The TP collectives' cost (core/dryrun/asynctp.py `TPCost`) in one block's forward, backward and
    selective-op recompute (core/dryrun/asynctp.py: NCCL in full, or what AsyncTP leaves). The
    recompute runs the two forward all-gathers again (the saved reduce-scatter outputs spare
    those), fused with the matmuls it recomputes."""
    if s.tp <= 1:
        return {k: TPCost(0.0, 0.0, 0.0) for k in ("fwd", "bwd", "rec")}
    on = cfg.parallelism.enable_async_tp
    col = block_collectives(s, recipe)
    gathers = [
        dataclasses.replace(c, matmuls=tuple(m for m in c.matmuls if m[0] in recomputed))
        for c in col["fwd"]
        if c.kind == "ag"
    ]
    parts = {"fwd": col["fwd"], "bwd": col["bwd"], "rec": gathers}
    batched = _batched(cfg)
    out = {k: exposed(spec, link, v, s.tokens, s.tp, on, batched) for k, v in parts.items()}
    out["bwd"] = out["bwd"]._replace(copies=out["bwd"].copies + fused_gather_copies(spec, link, col, on, batched))
    return out


def block_times(cfg, s: Shapes, spec: GPUSpec, links: dict, stack: Stack = THIS_TRAINER) -> dict:
    """Seconds of one block for one microbatch: forward, recompute, backward, each split into
    compute / memory_bound / exposed tp / exposed cp. `stack`: the software's attention kernel
    and RMSNorm (core/dryrun/stack.py)."""
    r = _Rates(spec, stack.cudnn_attention)
    p, ac = cfg.parallelism, cfg.activation_checkpoint
    compiled = cfg.compile.enabled
    fl = block_flops(s, cfg.training.seq_len)
    lin = block_linear_seconds(spec, s, cfg)
    attn_f = fl["attention"] / r.attn_f
    attn_b = FLASH_BWD_OVER_FWD * fl["attention"] / r.attn_b
    pointwise = _pointwise_bytes(s, compiled, stack.fused_rms_norm)
    pw_f = pointwise / r.hbm + lin["fwd_cast"]
    # Backward moves about twice the forward's bytes (gradient in, saved input, gradient out);
    # compiled, the min-cut partitioner also reruns the fused forward kernels it did not save.
    pw_b = (3 if compiled else 2) * pointwise / r.hbm + lin["bwd_cast"]
    # CP: ring attention as torch runs it (core/dryrun/ring.py): the k/v and dk/dv exchanges
    # nothing hides, and the eager fp32 merge / accumulation glue around the per-step SDPA calls.
    cp_f = cp_b = 0.0
    if s.cp > 1:
        n = s.tokens * s.q  # elements of the local q, and of k and v after repeat_kv
        cp_f, cp_b = ring.exposed_comm(n, s.cp, p.cp_rotate_method, links["cp"], attn_f, attn_b)
        glue_f, glue_b = ring.glue_bytes(s.cp)
        pw_f += glue_f * n / r.hbm
        pw_b += glue_b * n / r.hbm
    # Selective op AC with every other matmul saved recomputes wk, wo, w3 and every pointwise
    # op, Float8's casts included. Under Float8 too: the policy's dispatch mode runs before
    # torchao's tensor subclass, so it sees each float8 matmul as aten.mm on two
    # Float8TrainingTensors (counted like a bf16 one), never the _scaled_mm inside it
    # (torch/utils/checkpoint.py _CachingTorchDispatchMode; under compile the policy tags every
    # node the op traced into, the _scaled_mm included).
    every_other = ac.mode == "selective" and ac.selective_ac_option == "op" and ac.save_every_other_mm
    recomputed = ("wk", "wo", "w3") if every_other else ()
    tp = _tp_seconds(cfg, s, spec, links["tp"], lin["recipe"], recomputed)
    f, b, r = tp["fwd"], tp["bwd"], tp["rec"]
    fwd = {"compute": lin["fwd_mm"] + attn_f + f.work, "memory_bound": pw_f + f.copies, "tp": f.comm, "cp": cp_f}
    bwd = {"compute": lin["bwd_mm"] + attn_b + b.work, "memory_bound": pw_b + b.copies, "tp": b.comm, "cp": cp_b}
    if ac.mode == "full":
        rec = {"compute": fwd["compute"] + fwd["memory_bound"], "tp": fwd["tp"], "cp": fwd["cp"]}
    elif ac.mode == "selective" and ac.selective_ac_option == "op":
        mm_re = sum(lin["per_linear"][name][0] for name in recomputed)
        attn_re = attn_f if stack.sac_recomputes_attention and stack.cudnn_attention else 0.0
        rec = {"compute": mm_re + attn_re + pw_f + r.work + r.copies, "tp": r.comm, "cp": 0.0}
    elif ac.mode == "selective":
        k = int(ac.selective_ac_option)
        rec = {"compute": (fwd["compute"] + fwd["memory_bound"]) / k, "tp": fwd["tp"] / k, "cp": fwd["cp"] / k}
    else:
        rec = {"compute": 0.0, "tp": 0.0, "cp": 0.0}
    return {"fwd": fwd, "bwd": bwd, "recompute": rec}


def head_times(cfg, s: Shapes, spec: GPUSpec, links: dict, vocab: int, loss_compiled: bool = False) -> dict:
    """Final norm + output projection (bf16: Float8 filters it) + cross-entropy, one microbatch:
    forward and backward seconds, and the exposed TP part (all-gather of the normed input,
    loss parallel's two scalar-per-token all-reduces; the head is not compiled, so AsyncTP
    leaves them to NCCL)."""
    r = _Rates(spec)
    T = s.tokens
    V = vocab // s.tp
    f, gi, gw = linear_gemm_shapes(T, V, s.d)
    mm_f = gemm_seconds(spec, *f, "bf16")
    mm_b = gemm_seconds(spec, *gi, "bf16") + gemm_seconds(spec, *gw, "bf16")
    # Cross-entropy: bf16 logits -> fp32 copy -> log-softmax -> NLL (18 bytes per logit each way);
    # compiled with the model (`loss_compiled`), one kernel reads the bf16 logits (2) and backward
    # reads them and writes their gradient (4).
    ce_f, ce_b = (2, 4) if loss_compiled else (18, 18)
    ce, ce_back = ce_f * T * V / r.hbm, ce_b * T * V / r.hbm
    norm = (8 if cfg.compile.enabled else 42) * T * s.sp * s.d / r.hbm
    tp = 0.0
    if s.tp > 1:
        tp = links["tp"].ring(T * s.d * 2)
        if cfg.parallelism.loss_parallel:
            tp += 2 * links["tp"].ring(4 * T * s.tp)
    return {
        "fwd": {"compute": mm_f, "memory_bound": ce + norm + _sp_copy(cfg, s, spec, "ag"), "tp": tp},
        "bwd": {"compute": mm_b, "memory_bound": ce_back + 2 * norm + _sp_copy(cfg, s, spec, "rs"), "tp": tp},
    }


# =============================================================================================
# The step
# =============================================================================================
def _sum(d: dict, keys=("compute", "memory_bound", "tp", "cp")) -> float:
    return sum(d.get(k, 0.0) for k in keys)


class _Acc:
    """Breakdown accumulator (seconds)."""

    def __init__(self):
        self.parts = {"compute": 0.0, "memory_bound": 0.0, "recompute": 0.0}
        self.comm: dict[str, float] = {}

    def add(self, d: dict, scale: float = 1.0, recompute: bool = False):
        if recompute:
            self.parts["recompute"] += scale * d.get("compute", 0.0)
        else:
            self.parts["compute"] += scale * d.get("compute", 0.0)
            self.parts["memory_bound"] += scale * d.get("memory_bound", 0.0)
        for k in ("tp", "cp"):
            if d.get(k):
                self.comm[k] = self.comm.get(k, 0.0) + scale * d[k]

    def comm_add(self, key: str, t: float):
        if t > 0:
            self.comm[key] = self.comm.get(key, 0.0) + t


def _stage_costs(blk: dict, head: dict, emb: dict, stage: StageParams) -> dict:
    """Seconds of one microbatch's F and B on a stage (compute path only) and their breakdown."""
    f_parts, b_parts = [], []
    f_parts.append((blk["fwd"], stage.layers, False))
    b_parts += [(blk["bwd"], stage.layers, False), (blk["recompute"], stage.layers, True)]
    if stage.first:
        f_parts.append((emb["fwd"], 1, False))
        b_parts.append((emb["bwd"], 1, False))
    if stage.last:
        f_parts.append((head["fwd"], 1, False))
        b_parts.append((head["bwd"], 1, False))
    f = sum(n * _sum(d) for d, n, _ in f_parts)
    b = sum(n * _sum(d) for d, n, _ in b_parts)
    return {"F": f, "B": b, "f_parts": f_parts, "b_parts": b_parts}


def _emb_times(cfg, s, spec, links, vocab) -> dict:
    """Token embedding: a gather forward (and, with TP, the reduce-scatter of its row-wise
    output); backward zeroes and scatter-adds into the full local table."""
    r = _Rates(spec)
    T = s.tokens
    tp = links["tp"].ring(T * s.d * 2) if s.tp > 1 else 0.0
    return {
        "fwd": {"memory_bound": 4 * T * s.d / r.hbm + _sp_copy(cfg, s, spec, "rs"), "tp": tp},
        "bwd": {
            "memory_bound": (8 * T * s.d + 4 * vocab // s.tp * s.d) / r.hbm + _sp_copy(cfg, s, spec, "ag"),
            "tp": tp,
        },
    }


@dataclass(frozen=True)
class _Step:
    """What every part of the step reads: the config, the model's shapes, the mesh's links, the
    FSDP shard degree, the gradient accumulation steps and the seconds of one microbatch on a
    block, on the head and on the embedding."""

    cfg: JobConfig
    spec: GPUSpec
    args: ModelArgs
    shapes: Shapes
    dims: ParallelDims
    links: dict
    shard: int
    accum: int
    blk: dict
    head: dict
    emb: dict
    stack: Stack = THIS_TRAINER


def _step_inputs(cfg, spec: GPUSpec, stack: Stack = THIS_TRAINER) -> _Step:
    from core.parallel.mesh import ParallelDims

    p = cfg.parallelism
    dims = ParallelDims.from_config(p)
    a = model_args(cfg, None)
    s = shapes(cfg)
    sizes = {"pp": p.pp, "dp_replicate": p.dp_replicate, "dp_shard": p.dp_shard, "cp": p.cp, "tp": p.tp}
    fsdp_dims = ("dp_shard", "cp") if p.cp > 1 else ("dp_shard",)
    links = mesh_links(spec, sizes, fsdp_dims)
    shard = p.dp_shard * p.cp if dims.fsdp_enabled else 1
    accum = max(1, cfg.training.grad_accum_steps)
    blk = block_times(cfg, s, spec, links, stack)
    head = head_times(cfg, s, spec, links, a.vocab_size, fused_loss(cfg, stack.loss_compiled and cfg.compile.enabled))
    emb = _emb_times(cfg, s, spec, links, a.vocab_size)
    return _Step(cfg, spec, a, s, dims, links, shard, accum, blk, head, emb, stack)


def _flat_step(step: _Step, acc: _Acc) -> tuple[float, float, int]:
    """Without PP: each accumulation step's events in order (embedding, blocks, head forward and
    backward, blocks backward, embedding backward) with the FSDP stream beside them. Returns the
    forward-backward seconds, the bubble (none) and the parameters the rank holds."""
    a, blk, head, emb = step.args, step.blk, step.head, step.emb
    stage = stage_params(a, a.n_layers, True, True, step.cfg.parallelism.tp)
    ft = fsdp_times(step.cfg, step.links, step.dims.fsdp_enabled, step.shard, stage)
    costs = _stage_costs(blk, head, emb, stage)
    blk_f, blk_b = _sum(blk["fwd"]), _sum(blk["bwd"]) + _sum(blk["recompute"])
    # A block (or the root) FSDP reshards after forward is gathered again for its backward.
    resharded, root_resharded = reshard_after_forward(
        step.cfg.parallelism.fsdp_reshard_after_forward, a.n_layers, False
    )
    root_resharded = root_resharded and not step.stack.root_kept_gathered
    cp = fsdp_copies(step.cfg, _Rates(step.spec).hbm, step.dims.fsdp_enabled, stage)
    events = []
    for _ in range(step.accum):
        events.append((_sum(emb["fwd"]) + cp["ag_root"], ft["ag_root"], 0.0))
        events += [(blk_f + cp["ag_block"], ft["ag_block"], 0.0)] * a.n_layers
        events.append((_sum(head["fwd"]), 0.0, 0.0))
        events.append((_sum(head["bwd"]) + cp["ag_root"] * root_resharded, ft["ag_root"] * root_resharded, 0.0))
        for i in reversed(range(a.n_layers)):
            events.append(
                (blk_b + cp["ag_block"] * resharded[i] + cp["rs_block"], ft["ag_block"] * resharded[i], ft["rs_block"])
            )
        events.append((_sum(emb["bwd"]) + cp["rs_root"], 0.0, ft["rs_root"]))
        for d, n, rec in costs["f_parts"] + costs["b_parts"]:
            acc.add(d, n, rec)
        gathers = a.n_layers + sum(resharded)
        copies = (
            gathers * cp["ag_block"]
            + (1 + root_resharded) * cp["ag_root"]
            + a.n_layers * cp["rs_block"]
            + cp["rs_root"]
        )
        acc.add({"memory_bound": copies})
    busy = sum(e[0] for e in events)
    fb = fsdp_stream(events)
    acc.comm_add(step.links["fsdp"].label, fb - busy)
    return fb, 0.0, stage.total


def _action_seconds(costs: dict, first_f: dict, sid: int, kind: str, m: int) -> float:
    """One action of the schedule table: F (a stage's first one also waits for its FSDP
    gather), B, or I and W (half a backward each)."""
    c = costs[sid]
    if kind == "F":
        return c["F"] + (first_f[sid] if m == 0 else 0.0)
    return c["B"] if kind == "B" else c["B"] / 2


def _pp_stages(step: _Step, placement: list, n_stages: int) -> tuple[dict, dict, dict, dict]:
    """Per stage id: its parameters, its F and B costs, its FSDP times and what its first forward
    waits for the gather. FSDP under PP gathers a stage once, at its first forward (blocks
    prefetched behind that forward), keeps it, and reduce-scatters once after the last backward."""
    a, tp = step.args, step.cfg.parallelism.tp
    stages = {
        sid: stage_params(a, len(layers), sid == 0, sid == n_stages - 1, tp)
        for rank in placement
        for sid, layers in rank
    }
    costs = {sid: _stage_costs(step.blk, step.head, step.emb, stage) for sid, stage in stages.items()}
    ft = {
        sid: fsdp_times(step.cfg, step.links, step.dims.fsdp_enabled, step.shard, stage)
        for sid, stage in stages.items()
    }
    first_f = {}
    hbm = _Rates(step.spec).hbm
    for sid, stage in stages.items():
        ag_stage = stage.layers * ft[sid]["ag_block"] + ft[sid]["ag_root"]
        first_f[sid] = ft[sid]["ag_block"] + max(0.0, ag_stage - ft[sid]["ag_block"] - costs[sid]["F"])
        # FSDP's copies on the compute stream: the gathered stage's copy-out at its first forward,
        # the reduce-scatters' copy-in after its last backward (core/dryrun/fsdp_cost.py).
        cp = fsdp_copies(step.cfg, hbm, step.dims.fsdp_enabled, stage)
        ft[sid]["copy_in"] = stage.layers * cp["ag_block"] + cp["ag_root"]
        ft[sid]["copy_out"] = stage.layers * cp["rs_block"] + cp["rs_root"]
        first_f[sid] += ft[sid]["copy_in"]
    return stages, costs, ft, first_f


def _pipelined_step(step: _Step, acc: _Acc) -> tuple[float, float, int]:
    """With PP: the schedule's table run with the stages' costs (and again with free send/recv:
    the difference is the exposed PP time), each rank's reduce-scatters after its last action;
    the slowest rank sets the step. Returns the forward-backward seconds, the bubble and the most
    parameters a rank holds."""
    from core.parallel.schedule_sim import run_schedule  # local: torch, needed only with pp > 1
    from core.parallel.stages import stages_per_rank

    p, s = step.cfg.parallelism, step.shapes
    placement = rank_stages(step.cfg)
    n_stages = sum(len(x) for x in placement)
    n_micro = microbatches(step.cfg)
    table = schedule_table(p.pp_schedule, p.pp, n_micro, stages_per_rank(p, step.args.n_layers))
    stages, costs, ft, first_f = _pp_stages(step, placement, n_stages)
    cost = functools.partial(_action_seconds, costs, first_f)
    hop = step.links["pp"].p2p(s.tokens * s.sp * s.d * 2)
    free1, _ = run_schedule(table, n_stages, cost, hop)
    free0, _ = run_schedule(table, n_stages, cost, 0.0)
    tails = [
        sum(stages[sid].layers * ft[sid]["rs_block"] + ft[sid]["rs_root"] + ft[sid]["copy_out"] for sid, _ in rank)
        for rank in placement
    ]
    ends = [f + tl for f, tl in zip(free1, tails, strict=True)]
    r = max(range(p.pp), key=lambda i: ends[i])
    fb = step.accum * ends[r]
    fsdp_label = step.links["fsdp"].label
    copies = sum(ft[sid]["copy_in"] + ft[sid]["copy_out"] for sid, _ in placement[r])
    for sid, _ in placement[r]:
        for d, n, rec in costs[sid]["f_parts"] + costs[sid]["b_parts"]:
            acc.add(d, n * n_micro * step.accum, rec)
        acc.comm_add(fsdp_label, step.accum * (first_f[sid] - ft[sid]["copy_in"]))
    acc.comm_add(fsdp_label, step.accum * (tails[r] - sum(ft[sid]["copy_out"] for sid, _ in placement[r])))
    acc.add({"memory_bound": copies}, step.accum)
    acc.comm_add("pp", step.accum * max(0.0, max(free1) - max(free0)))
    bubble = max(0.0, fb - sum(acc.parts.values()) - sum(acc.comm.values()))
    params_local = max(sum(stages[sid].total for sid, _ in rank) for rank in placement)
    return fb, bubble, params_local


def _prediction(step: _Step, acc: _Acc, fb: float, bubble: float, params_local: int, memory: dict | None) -> dict:
    """The step: forward-backward, the grad-norm all-reduce(s) and the optimizer; from it tokens/s
    per GPU and MFU, the breakdown, and whether the memory estimate fits the GPU."""
    from core.metrics import flops_per_token

    p, t, spec = step.cfg.parallelism, step.cfg.training, step.spec
    grad_norm = step.links["world"].small_all_reduce() * (2 if p.pp > 1 else 1)
    optimizer = adamw.bytes_per_param(step.cfg.optimizer.implementation) * params_local / step.shard / _Rates(spec).hbm
    acc.comm_add("grad_norm", grad_norm)
    precompute = 0.0
    if fp8_all_gather(step.cfg) and step.cfg.float8.precompute_float8_dynamic_scale_for_fsdp:
        # torchao's precompute_float8_dynamic_scale_for_fsdp: a foreach max-norm over the local
        # fp32 shards and one all-reduce for every weight's scale, after the optimizer step.
        optimizer += 4 * params_local / step.shard / _Rates(spec).hbm
        precompute = step.links["fsdp"].small_all_reduce()
        acc.comm_add(step.links["fsdp"].label, precompute)
    step_s = fb + grad_norm + optimizer + precompute
    tokens_step = t.local_batch_size * t.seq_len * step.accum * step.dims.dp
    tps = tokens_step / step.dims.world_size / step_s
    mfu = flops_per_token(step.args, t.seq_len) * tps / spec.peak_bf16_flops
    mem = memory if memory is not None else estimate_memory(step.cfg, gpu_gib=spec.hbm_capacity_gib)
    breakdown = {**acc.parts, "exposed_comm": dict(acc.comm), "bubble": bubble, "optimizer": optimizer}
    return {
        "gpu": spec.name,
        "step_time_s": step_s,
        "tokens_per_sec_per_gpu": tps,
        "mfu": mfu,
        "breakdown": breakdown,
        "fits": mem["allocated_peak_gib"] <= spec.hbm_capacity_gib,
        "allocated_peak_gib": mem["allocated_peak_gib"],
        "capacity_gib": spec.hbm_capacity_gib,
        "links": {k: {"group": v.size, "across_nodes": v.nodes_spanned} for k, v in step.links.items()},
        "calibration": spec.calibration or "none: every constant from datasheets and cited benchmarks",
        "error_band": accuracy.text(kind=accuracy.kind_of(step.cfg, spec.name)),
    }


def predict(cfg, gpu: str | GPUSpec = DEFAULT_GPU, memory: dict | None = None, stack: Stack = THIS_TRAINER) -> dict:
    """Step time, tokens/s per GPU, MFU and the breakdown (seconds) of a validated config on a
    GPU system (a spec name, see core/dryrun/hardware, or a GPUSpec). `memory`: the config's
    `estimate_memory` result if the caller has it (else computed) for `fits`; `stack`: the
    software that ran it, where it differs from this trainer (core/dryrun/stack.py)."""
    spec = gpu if isinstance(gpu, GPUSpec) else load_spec(gpu)
    step = _step_inputs(cfg, spec, stack)
    acc = _Acc()
    run = _flat_step if cfg.parallelism.pp == 1 else _pipelined_step
    fb, bubble, params_local = run(step, acc)
    return _prediction(step, acc, fb, bubble, params_local, memory)
