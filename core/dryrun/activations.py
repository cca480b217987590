"""Dry-run activation accounting: what one rank holds per microbatch (Shapes), the bytes one
transformer block and the loss head save and work with, per AC mode, compile, Float8, TP/SP, CP.

Torch-free, like core/dryrun/memory.py, whose timeline adds these terms up.
"""

from __future__ import annotations

from dataclasses import dataclass

from core.models.args import model_args
from core.parallel.stages import pp_microbatches

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
    res: int  # bytes of an element of the residual stream (4 under autocast: bf16 without FSDP)
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
    # Without FSDP, bf16 runs under autocast (core/step.py, core/parallel/pipeline.py), which
    # leaves the residual additions in fp32.
    autocast = act == 2 and p.dp_replicate * p.dp_shard * p.cp == 1
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
        res=4 if autocast else act,
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
    SwiGLU keeps w1's and w3's outputs, the SiLU output and the product. Compiled (measured on
    torch 2.13, tests/test_estimate.py): the block input and the norms' rstd, each matmul's input
    (the two normed activations, SDPA's output copied for wo, SiLU x w3 for w2), q/k/v, SDPA's
    output and LSE, and w1's and w3's outputs; the rest is recomputed.
    """
    T, a = s.tokens, s.act
    sp_T = T * s.sp
    kv_sdpa = s.q if s.n_rep > 1 else s.kv  # k and v as SDPA sees them (expanded to q heads)
    lin_in = s.lin_in if s.tp > 1 else a
    if compiled:
        return {
            "block_input": sp_T * s.res * s.d + 2 * sp_T * 4,
            "linear_inputs": 2 * T * lin_in * s.d + T * a * s.q + T * a * s.f,
            "qkv": T * a * (s.q + 2 * s.kv),
            "attention_out": T * (a * s.q + 4 * s.heads),
            "ffn_hidden": 2 * T * a * s.f,
        }
    return {
        "norm": 2 * sp_T * (4 * s.d + s.res * s.d + 4),
        "linear_inputs": 2 * T * lin_in * s.d,
        "sdpa_qkv": T * a * (s.q + 2 * kv_sdpa),
        "attention_out": T * (a * s.q + 4 * s.heads),
        "ffn_hidden": 4 * T * a * s.f,  # w1 out, silu out, w3 out, product
    }


def _sac_op_saved(s: Shapes, every_other_mm: bool, compiled: bool = False) -> dict[str, float]:
    """Selective op AC (core/toggles/activation_checkpoint.py SAVE_OPS): the block input, every
    matmul output (or every second one, torchtitan's variant), SDPA's outputs and, under TP, the
    reduce-scatter outputs; everything else is recomputed.

    Eager, the policy's cache keeps every output it saves until the block's recompute. Compiled,
    AOTAutograd saves only what backward reads: not the outputs of wo and w2 (and of their TP
    reduce-scatters), whose one reader is the residual add (measured: a compiled block on torch
    2.13 saves x, wq's, wv's, SDPA's and w1's outputs and no w2 output)."""
    T, a = s.tokens, s.act
    sp_T = T * s.sp
    row_out = T * a * s.d  # wo / w2 matmul outputs (under TP: the partial sums before reduce-scatter)
    mms: list[float] = [T * a * s.q, T * a * s.kv, T * a * s.kv, row_out, T * a * s.f, T * a * s.f, row_out]
    if compiled:
        mms[3] = mms[6] = 0.0
    if every_other_mm:
        mms = mms[0::2]
    out = {
        "block_input": sp_T * s.res * s.d,
        "matmul_outputs": float(sum(mms)),
        "attention_out": T * (a * s.q + 4 * s.heads),
    }
    if s.tp > 1 and not compiled:
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


def layer_memory(cfg, s: Shapes | None = None, extra: dict | None = None) -> dict:
    """Saved bytes of one block after its forward (per microbatch) and the extra working set
    while one block runs forward and while it recomputes + runs backward. `extra`: what the
    Float8 linears add ({"saved": {part: bytes}, "work": bytes}, core/dryrun/linears.py
    `float8_memory`)."""
    s = s or shapes(cfg)
    extra = extra or {"saved": {}, "work": 0.0}
    ac = cfg.activation_checkpoint
    compiled = cfg.compile.enabled
    noac = _noac_saved(s, compiled)
    noac_total = sum(noac.values())
    T, a = s.tokens, s.act
    block_input = T * s.sp * s.res * s.d
    # Of the saved bytes, the block input itself (under PP a stage's first block saves the
    # schedule's receive buffer, which pp_buffers already counts): checkpointed blocks and
    # inductor's graphs keep it; eager autograd keeps the norm's fp32 upcast instead.
    noac_input = block_input if compiled else 0.0
    if ac.mode == "none":
        saved, input_saved = noac, noac_input
    elif ac.mode == "full":
        saved, input_saved = {"block_input": block_input}, block_input
    elif ac.selective_ac_option == "op":
        saved = _sac_op_saved(s, getattr(ac, "save_every_other_mm", False), compiled)
        input_saved = block_input
    else:  # every k-th block fully checkpointed: average over the blocks
        k = int(ac.selective_ac_option)
        saved = {"block_input_or_all": ((k - 1) * noac_total + block_input) / k}
        input_saved = ((k - 1) * noac_input + block_input) / k
    saved = {**saved, **{k: v for k, v in extra["saved"].items() if v}}
    saved_total = sum(saved.values())
    # Working set beyond what is saved (checked against torch's MemTracker in
    # tests/test_estimate.py). Forward, at the FFN: the all-gathered input and the partial output
    # of the row-wise projection (TP) or the block's output, and three FFN-hidden tensors (one
    # compiled: inductor fuses the SwiGLU chain); at the attention: ring attention's buffers.
    # Backward, at the FFN: the block's recomputed activations, the full-sequence output gradient
    # and two FFN-hidden gradients (one compiled); at the attention, after the FFN's activations
    # are freed: q/k/v gradients and ring attention's buffers.
    full_seq = T * s.res * s.d  # the block output gradient: fp32 where the residual is (autocast)
    hidden = T * a * s.f
    kv_sdpa = s.q if s.n_rep > 1 else s.kv
    io = (2 if s.tp > 1 else 1) * full_seq
    ffn_fwd = (1 if compiled else 3) * hidden + io
    attn_fwd = io + _cp_attention_work(s, backward=False)
    recompute = max(0.0, noac_total - saved_total) if ac.mode != "none" else 0.0
    ffn_part = noac["ffn_hidden"] + (noac.get("norm", 0) + noac.get("block_input", 0) + noac["linear_inputs"]) / 2
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
        "fwd_work": max(ffn_fwd, attn_fwd) + extra["work"],
        "bwd_work": max(ffn_bwd, attn_bwd) + extra["work"],
    }


def fused_loss(cfg, loss_compiled: bool) -> bool:
    """The compiled loss is one fused kernel (core/dryrun/stack.py `loss_compiled`), except under
    loss parallel: there the loss is DTensor's handlers (torch/distributed/tensor/parallel/loss.py:
    log-softmax and NLL with an all-reduce of the max and of the sum between them), which keep the
    fp32 logits and the log-softmax output, compiled or not."""
    p = cfg.parallelism
    return loss_compiled and not (p.tp > 1 and p.loss_parallel)


def chunked(hm: dict, chunks: int, s: Shapes) -> dict:
    """The head's memory when the loss runs in `chunks` sequence chunks (core/dryrun/stack.py
    `loss_chunks`): each chunk's logits and loss tensors are a chunk's share, freed by its own
    backward, and the hidden states' gradient gathers in an fp32 [T, D] buffer."""
    if chunks <= 1:
        return hm
    out = {k: v / chunks for k, v in hm.items() if k in ("log_softmax", "loss_fwd_work", "logits", "logits_grad")}
    out["loss_bwd_work"] = hm["loss_bwd_work"] / chunks + 4 * s.tokens * s.d
    out["saved"] = hm["norm_saved"] + out["log_softmax"]
    return {**hm, **out}


def head_memory(cfg, s: Shapes | None = None, loss_compiled: bool = False) -> dict:
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

    `loss_compiled` (torchtitan's compiled loss, core/dryrun/stack.py): the model returns bf16
    logits and one fused kernel computes the loss from them, keeping them (2 bytes a logit) and
    each row's log-sum-exp for backward, which writes their bf16 gradient once: no fp32 copy, no
    log-softmax output.
    """
    s = s or shapes(cfg)
    T, a, V = s.tokens, s.act, s.vocab
    lp = s.tp > 1 and cfg.parallelism.loss_parallel
    if fused_loss(cfg, loss_compiled):
        norm_saved = T * s.sp * (4 * s.d + a * s.d + 4) + T * a * s.d
        return {
            "saved": norm_saved + a * T * V + 4 * T,
            "norm_saved": norm_saved,
            "log_softmax": 4 * T,
            "loss_fwd_work": 0.0,
            "loss_bwd_work": a * T * V,
            "logits": a * T * V,
            "logits_grad": T * V * a,
        }
    lp = 4 if lp else 0
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
