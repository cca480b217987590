"""Adam(W)'s step as torch runs each `optimizer.implementation` (core/optim.py ADAM_KERNELS): the
HBM bytes it moves per local fp32 parameter, and the temporaries it allocates. Read by the
performance model (core/dryrun/runtime.py) and the memory accounting (core/dryrun/memory.py).

Counted from torch/optim/adam.py (the path AdamW takes, capturable off, weight decay on):
- foreach (`_multi_tensor_adam`): weight decay p *= (8 bytes), lerp of m toward g (12), v *= beta2
  (8), addcmul of g * g into v (16), sqrt of v into a new list (8), divide (8), add eps (8), addcdiv
  into p (16): 84 bytes. The sqrt's list is one parameter-sized fp32 temporary.
- for-loop (`_single_tensor_adam`): the same ops one tensor at a time: 84 bytes, and temporaries
  of one tensor (sqrt and its quotient: two of the largest), as read from the source; unlike the
  other two, not checked against torch's MemTracker, whose count of this path we could not
  reconcile with the source. Its per-tensor launches are not priced.
- fused (`_fused_adam`, one kernel): reads p, g, m and v, writes p, m and v: 28 bytes, no temporary.
  Measured on one H200 (results/gpu/2026-11-27-nvidia-h200-6da30e3): 23.8 ms for 2.8 B parameters,
  3.3 TB/s.
Grad-norm clipping (core/optim.py clip_grad_norm_: a foreach norm, then a foreach scale in place)
reads the gradient twice and writes it once: 12 bytes, with every implementation.
"""

from __future__ import annotations

CLIP_BYTES = 12
STEP_BYTES = {"foreach": 84, "for-loop": 84, "fused": 28}


def bytes_per_param(implementation: str) -> int:
    """HBM bytes the optimizer step and grad clipping move per local fp32 parameter."""
    return STEP_BYTES[implementation] + CLIP_BYTES


def temporary_bytes(implementation: str, local_params: float, largest_local: float) -> float:
    """Bytes of the step's fp32 temporaries at its peak (`largest_local`: the rank's largest
    parameter tensor, in elements)."""
    if implementation == "foreach":
        return 4 * local_params
    if implementation == "for-loop":
        return 2 * 4 * largest_local
    return 0.0
