"""Known library messages that say nothing about a run, dropped once per process by name.

Each entry is (logger or "warnings", message start, why it is noise). Only these exact messages
are dropped; everything else a library logs still shows. The trainer installs the filters at
start (and the dry-run's fake step, and DCP's checkpoint process when it re-imports core.train).
"""

from __future__ import annotations

import logging
import re
import warnings

KNOWN_NOISE = (
    (
        "torchao",
        "Failed to load ",
        "torchao's prebuilt kernels (mxfp8, cutlass sm90a) that a CPU-only or other-Python install cannot "
        "load; Float8 training uses torch._scaled_mm (or its emulation), not those kernels",
    ),
    (
        "torch.utils._pytree",
        "<enum 'KernelPreference'> is an Enum subclass",
        "torch's deprecation notice about torchao registering its KernelPreference enum (torchao's to fix)",
    ),
    (
        "torch._higher_order_ops.wrap",
        "\nDetected that context_fn is passed to torch.utils.checkpoint",
        "selective AC under compile: a caution against in-place ops, which the model's blocks do not use",
    ),
    (
        "warnings",
        "Torchinductor does not support code generation for complex operators",
        "RoPE's complex multiply runs eager inside the compiled block (as in torchtitan)",
    ),
    (
        "torch.distributed.device_mesh",
        "It seems like pickling/unpickling of the DeviceMesh",
        "DCP's checkpoint process unpickles DTensors without the training groups; it never compiles",
    ),
    (
        "torch.distributed.tensor._redistribute",
        "While redistributing from (_NormPartial",
        "the dry-run fake step's FSDP x TP gradient norm: two scalar all-reduces, one per mesh dim",
    ),
    (
        "root",
        "Initializing dist.ProcessGroup in checkpoint background process",
        "DCP's checkpoint process (async_with_pinned_mem) reporting its start-up and every request",
    ),
    (
        "datasets.packaged_modules.json.json",
        "Failed to load JSON from file",
        "the json reader's report of a malformed document, before it raises; the trainer names the "
        "file and line in its own error (core/data/documents.py)",
    ),
    ("root", "Checkpoint background process is running", "as above"),
    ("root", "Waiting for checkpoint save request", "as above"),
    ("root", "Received async checkpoint request", "as above"),
    ("root", "Completed checkpoint save request", "as above"),
    (
        "warnings",
        "Float8TrainingTensor does not implement _stable_hash_for_caching",
        "AOTAutograd keys a Float8 block's subclass inputs by torch's default (the flatten context and "
        "inner tensors' metadata), stable across processes: a warm rerun hits (tests/test_compile_cache.py)",
    ),
    (
        "warnings",
        "torch.distributed is disabled, unavailable or uninitialized, assuming the intent is",
        "DCP on the single-process tools (export / import), which pass no_dist=True on purpose",
    ),
)


class _DropKnown(logging.Filter):
    def __init__(self, starts: tuple[str, ...]):
        super().__init__()
        self.starts = starts

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(self.starts)


def quiet_library_warnings() -> None:
    """Install the KNOWN_NOISE filters (idempotent)."""
    for name in {logger for logger, _, _ in KNOWN_NOISE} - {"warnings"}:
        log = logging.getLogger(None if name == "root" else name)
        if not any(isinstance(f, _DropKnown) for f in log.filters):
            log.addFilter(_DropKnown(tuple(start for lg, start, _ in KNOWN_NOISE if lg == name)))
    for logger, start, _ in KNOWN_NOISE:
        if logger == "warnings":
            warnings.filterwarnings("ignore", message=re.escape(start))
