"""Context parallelism's ring attention as torch runs it, for the performance model
(core/dryrun/runtime.py): one attention call on one CP rank, forward and backward.

Everything here is read off torch's implementation
(torch/distributed/tensor/experimental/_context_parallel/_attention.py:
`_templated_ring_attention`, `_templated_ring_attention_backward`, `_SDPAMerger`,
`_AllGatherRotater`, `_AllToAllRotater`, `_partial_update`) and off the model
(core/models/llama3.py): no constant is fitted.

Shapes. The model repeats k and v to the query heads (`repeat_kv`) before SDPA, so the k and v
the ring passes, and their gradients, are as wide as q. A rank holds T tokens in two round-robin
chunks (rank r: chunks r and 2c-1-r of 2c). Step 0 is causal SDPA on the local q, k, v; each
step i > 0 runs SDPA without a mask on either the whole q against the first half of the
received k, v (i <= r) or the second half of q against the whole received k, v (i > r): every
step has the same FLOPs, 1/c of the call's (the model's attention FLOPs already count that).

Communication. `allgather`: one all-gather of every rank's k, v issued before step 0 and awaited
at step 1 (it hides behind step 0 only); `alltoall`: a send/recv per step, each awaited at the
next step (it hides behind one step). Backward passes k, v the same way and the fp32 dk, dv
gradients around the ring with a send/recv after every step (always all-to-all), awaited after
the next step's SDPA; the last one is awaited after the loop, with nothing left to hide it. The
k/v and dk/dv exchanges share the CP process group, hence one NCCL stream: under `alltoall`
each backward step hides both the previous step's dk/dv and this step's k/v.

Memory-bound glue (eager, fp32 with `_cp_options.convert_to_f32`), bytes per element of one of
q, k, v, out (n = T x local query width), see `glue_bytes`.
"""

from __future__ import annotations

# HBM bytes per element, from the ops in torch's source (bf16 = 2 bytes, fp32 = 4 bytes):
CONTIGUOUS_KV = 8  # key.contiguous(), value.contiguous(): repeat_kv's output transposed, copied
CAT_KV = 8  # torch.cat([key.flatten(), value.flatten()]) before every exchange but the last
CAST_OUT_F32 = 6  # each step's block output to fp32 (read 2, write 4)
MERGE = 32  # out - sigmoid(lse diff) * (out - block_out): sub (12), mul (8), sub (12), fp32
PARTIAL_CAT = 8  # _partial_update: torch.cat of the two fp32 halves of out (read 4, write 4)
CAST_OUT_BF16 = 6  # results(): out back to bf16 (read 4, write 2)
ZEROS_GRADS = 12  # zeros_like(q, k, v) in fp32 for dq, dk, dv
ADD_GRAD = 10  # fp32 accumulator += bf16 step gradient (read 4 + 2, write 4)
CAT_DKV = 16  # torch.cat of the fp32 dk, dv before each send (read 4, write 4, two tensors)
CAST_GRADS_BF16 = 18  # dq, dk, dv back to bf16 at the end (read 4, write 2, three tensors)


def glue_bytes(cp: int) -> tuple[float, float]:
    """(forward, backward) HBM bytes per element of the slowest CP rank's attention call (multiply
    by T x local query width); the last rank (r = cp - 1) takes the whole-q branch at every step,
    which moves the most. Zero without CP: plain SDPA runs."""
    if cp <= 1:
        return 0.0, 0.0
    steps = cp - 1
    # forward: copies, step 0's output cast, per step i > 0 (r >= i): cast + merge of a whole-q
    # block, the k/v concatenation before each exchange, the final cast
    fwd = CONTIGUOUS_KV + CAST_OUT_F32 + steps * (CAST_OUT_F32 + MERGE) + steps * CAT_KV + CAST_OUT_BF16
    # backward: zeroed accumulators, copies; step 0 adds dk, dv and dq whole; steps i > 0 (i <= r)
    # add dk, dv into their first half and re-concatenate them (_partial_update: 5 + 8 per
    # element each) and add dq whole; every step concatenates dk, dv for the send; k/v
    # concatenation before each exchange; final casts
    first = 2 * ADD_GRAD + ADD_GRAD
    later = 2 * (ADD_GRAD / 2 + PARTIAL_CAT) + ADD_GRAD
    bwd = ZEROS_GRADS + CONTIGUOUS_KV + first + steps * later + cp * CAT_DKV + steps * CAT_KV + CAST_GRADS_BF16
    return fwd, bwd


def exposed_comm(n: float, cp: int, rotate: str, link, attn_f: float, attn_b: float) -> tuple[float, float]:
    """(forward, backward) seconds of ring communication nothing hides, one attention call:
    n = T x local query width, `link` the CP group's (core/dryrun/comms.Link), attn_f / attn_b
    the call's SDPA seconds (each step 1/cp of them)."""
    if cp <= 1:
        return 0.0, 0.0
    kv, dkv = 2 * n * 2, 2 * n * 4  # bf16 k, v; fp32 dk, dv (as wide as q: repeat_kv)
    step_f, step_b = attn_f / cp, attn_b / cp
    d = link.p2p(dkv)
    if rotate == "allgather":
        ag = link.ring(kv * cp)
        fwd = max(0.0, ag - step_f)
        bwd = max(0.0, ag - step_b) + (cp - 1) * max(0.0, d - step_b) + d
    else:
        x = link.p2p(kv)
        fwd = (cp - 1) * max(0.0, x - step_f)
        # behind step 0: k/v exchange 0; steps 1..cp-2: dk/dv i-1 and k/v i; step cp-1: dk/dv only
        bwd = max(0.0, x - step_b) + (cp - 2) * max(0.0, d + x - step_b) + max(0.0, d - step_b) + d
    return fwd, bwd
