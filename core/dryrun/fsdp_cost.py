"""What FSDP costs a step beside the compute: its collectives' seconds on their link
(core/dryrun/comms.py) and the stream they run on beside the compute, one block of prefetch.
Which units it gathers again for backward: core/parallel/reshard.py."""

from __future__ import annotations

from core.dryrun.linears import fp8_all_gather
from core.dryrun.memory import StageParams


def fsdp_bytes(cfg, stage: StageParams) -> dict:
    f8 = fp8_all_gather(cfg)
    red = 4 if cfg.training.mixed_precision_reduce == "float32" else 2
    return {
        "ag_block": stage.block_linear * (1 if f8 else 2) + (stage.block - stage.block_linear) * 2,
        "ag_root": stage.root * 2,
        "rs_block": stage.block * red,
        "rs_root": stage.root * red,
    }


# Float8 linears in a block (wq, wk, wv, wo, w1, w2, w3).
BLOCK_LINEARS = 7


def amax_reduces(cfg) -> int:
    """Amax all-reduces on FSDP's stream before a block's float8 all-gather: without precomputed
    scales each weight's pre-all-gather hook casts its shard with a scale it reduces first
    (torchao fsdp_utils.py WeightWithDynamicFloat8CastTensor.fsdp_pre_all_gather,
    `reduce_amax=True`); precomputed, one reduction for every weight after the optimizer step
    (`precompute_float8_dynamic_scale_for_fsdp`, core/dryrun/runtime.py)."""
    return BLOCK_LINEARS if fp8_all_gather(cfg) and not cfg.float8.precompute_float8_dynamic_scale_for_fsdp else 0


def fsdp_times(cfg, links: dict, on: bool, shard: int, stage: StageParams) -> dict:
    """Seconds of a stage's FSDP collectives: the all-gather of a block and of the root
    (embedding, norm, output), their reduce-scatters plus HSDP's all-reduce of the shard (`on`:
    FSDP shards at all)."""
    b = fsdp_bytes(cfg, stage)
    fl, rep = links["fsdp"], links["dp_replicate"]
    return {
        "ag_block": (fl.ring(b["ag_block"]) + amax_reduces(cfg) * fl.small_all_reduce()) if on else 0.0,
        "ag_root": fl.ring(b["ag_root"]) if on else 0.0,
        "rs_block": (fl.ring(b["rs_block"]) if on else 0.0) + rep.all_reduce(b["rs_block"] / shard),
        "rs_root": (fl.ring(b["rs_root"]) if on else 0.0) + rep.all_reduce(b["rs_root"] / shard),
    }


def fsdp_stream(events: list[tuple[float, float, float]]) -> float:
    """Compute events with the FSDP stream beside them: event k needs its all-gather a_k, issued
    when event k-1 starts (one block of prefetch), and issues its reduce-scatter r_k when it
    ends; the stream runs its collectives in issue order. Returns when the last one finishes."""
    comm_free = end_prev = 0.0
    ag_end = comm_free = events[0][1] if events else 0.0
    for k, (c, _, r) in enumerate(events):
        start = max(end_prev, ag_end)
        if k + 1 < len(events):  # the next all-gather is issued now, before this event's reduce-scatter
            ag_end = comm_free = max(comm_free, start) + events[k + 1][1]
        end_prev = start + c
        if r:
            comm_free = max(comm_free, end_prev) + r
    return max(end_prev, comm_free)


def fsdp_copies(cfg, hbm: float, on: bool, stage: StageParams) -> dict:
    """Seconds of the copies FSDP2 makes on the compute stream, at the streaming rate `hbm`
    (torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py): after an all-gather,
    `foreach_all_gather_copy_out` splits the gathered buffer into the unsharded parameters
    (reads and writes its bytes); before a reduce-scatter, `foreach_reduce` copies the unsharded
    gradients, as computed, into its input in the reduce dtype (`foreach_reduce_scatter_copy_in`,
    on the current stream: "Only after the copy-in finishes can we free the gradients")."""
    if not on:
        return dict.fromkeys(("ag_block", "ag_root", "rs_block", "rs_root"), 0.0)
    b = fsdp_bytes(cfg, stage)
    comp = 2 if cfg.training.mixed_precision_param == "bfloat16" else 4
    red = b["rs_block"] / stage.block  # bytes of a reduce-dtype element
    return {
        "ag_block": 2 * b["ag_block"] / hbm,
        "ag_root": 2 * b["ag_root"] / hbm,
        "rs_block": (comp + red) * stage.block / hbm,
        "rs_root": (comp + red) * stage.root / hbm,
    }
