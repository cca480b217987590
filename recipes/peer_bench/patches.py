"""The CPU fixes torchtitan 0.3.0 needs to train on a CPU with gloo, as named text edits of its
installed files.

Every patch names its file, why it is needed (one line) and its edits: an exact piece of the
installed text and what replaces it. A patch is applied only when each of its pieces occurs
exactly once; it is recognised as already applied when each replacement is present; anything else
(another torchtitan release moved the code) is refused with PatchError naming the patch and the
file. Inserted code carries the marker `peer-bench patch <name>`, so a reader of the installed
torchtitan sees what was changed. Torch-free: pure text.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from core.fileio import atomic_write

TORCHTITAN_VERSION = "0.3.0"  # the release these edits were written against


class PatchError(RuntimeError):
    """A patch does not apply to the installed file (another torchtitan release?)."""


@dataclass(frozen=True)
class Edit:
    old: str  # exact text of the installed file, expected once
    new: str  # what replaces it


@dataclass(frozen=True)
class Patch:
    name: str
    path: str  # inside the torchtitan package
    reason: str
    edits: tuple[Edit, ...]


def _mark(name: str) -> str:
    return f"# peer-bench patch {name}"


_CPU_MEMORY_STATS = f"""from torchtitan.tools.utils import Color, device_module, device_type, NoColor

if device_type == "cpu":  {_mark("cpu_memory_stats")}: torch.cpu keeps no memory statistics
    import resource as _resource
    from types import SimpleNamespace as _Namespace

    def _cpu_peak_rss(_device=None):
        peak = _resource.getrusage(_resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
        return {{"active_bytes.all.peak": peak, "reserved_bytes.all.peak": peak}}

    device_module = _Namespace(
        get_device_name=lambda _device=None: "cpu",
        current_device=lambda: 0,
        get_device_properties=lambda _device=None: _Namespace(
            total_memory=os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        ),
        reset_peak_memory_stats=lambda: None,
        empty_cache=lambda: None,
        memory_stats=_cpu_peak_rss,
    )
"""

_FLEX_CALL_SITE = (
    "        v_BNLH = v_BLNH.transpose(1, 2)\n\n        # 1. _compiled_flex_attn has to be a class variable"
)
_CAUSAL_SDPA = f"""        v_BNLH = v_BLNH.transpose(1, 2)

        if q_BNLH.device.type == "cpu" and score_mod is None and out_transform is None:
            {_mark("cpu_causal_sdpa")}: no FlexAttention backward on CPU
            with spmd.no_typecheck():
                out_BNLH = F.scaled_dot_product_attention(
                    q_BNLH, k_BNLH, v_BNLH, is_causal=True, scale=scale, enable_gqa=enable_gqa
                )
            return out_BNLH.transpose(1, 2)

        # 1. _compiled_flex_attn has to be a class variable"""

_BARRIER = f"""    if device_type == "cpu":  {_mark("cpu_barrier_and_pg_timeout")}: gloo takes no device_ids
        torch.distributed.barrier()
    else:
        torch.distributed.barrier(device_ids=[device_module.current_device()])"""

_SET_TIMEOUT = f"""    {_mark("cpu_barrier_and_pg_timeout")}: torch 2.13 has only the private _set_pg_timeout
    set_timeout = getattr(torch.distributed, "set_timeout", None) or c10d._set_pg_timeout
    for group in groups:
        set_timeout(timeout, group)"""

_FORCE_SUM = f"""            module.set_gradient_divide_factor(1.0)
            if torch.distributed.get_backend() == "gloo":  {_mark("gloo_plain_sum")}: gloo has no PREMUL_SUM
                module.set_force_sum_reduction_for_comms(True)"""

# The five fixes, one place: name -> file, why, edits.
PATCHES: tuple[Patch, ...] = (
    Patch(
        "cpu_device_fallback",
        "tools/utils.py",
        "with no accelerator torchtitan assumes CUDA; CPU instead gives torch.cpu and the gloo backend",
        (
            Edit(
                'device_type = _get_available_device_type() or "cuda"',
                f'device_type = _get_available_device_type() or "cpu"  {_mark("cpu_device_fallback")}',
            ),
        ),
    ),
    Patch(
        "cpu_memory_stats",
        "components/metrics.py",
        "the memory monitor calls CUDA's memory-stats API, which torch.cpu lacks: report peak RSS of host RAM",
        (Edit("from torchtitan.tools.utils import Color, device_module, device_type, NoColor\n", _CPU_MEMORY_STATS),),
    ),
    Patch(
        "cpu_causal_sdpa",
        "models/common/attention.py",
        "torch has no FlexAttention backward on CPU: causal SDPA instead (as our trainer; no document mask)",
        (Edit(_FLEX_CALL_SITE, _CAUSAL_SDPA),),
    ),
    Patch(
        "cpu_barrier_and_pg_timeout",
        "distributed/utils.py",
        "set_pg_timeouts passes the CPU device id 'cpu' to barrier() and calls torch.distributed.set_timeout, "
        "which torch 2.13 lacks (its _set_pg_timeout does the same)",
        (
            Edit("    torch.distributed.barrier(device_ids=[device_module.current_device()])", _BARRIER),
            Edit("    for group in groups:\n        torch.distributed.set_timeout(timeout, group)", _SET_TIMEOUT),
        ),
    ),
    Patch(
        "gloo_plain_sum",
        "distributed/fsdp.py",
        "a gradient divide factor of 1.0 makes FSDP reduce with PREMUL_SUM, which gloo rejects; a plain SUM "
        "is the same sum",
        (Edit("            module.set_gradient_divide_factor(1.0)", _FORCE_SUM),),
    ),
)


def _pending(patch: Patch, text: str) -> list[Edit]:
    return [e for e in patch.edits if e.new not in text]


def patch_state(patch: Patch, text: str) -> str:
    """'applied', 'applicable', or PatchError saying which piece of the text is missing."""
    pending = _pending(patch, text)
    if not pending:
        return "applied"
    for e in pending:
        n = text.count(e.old)
        if n != 1:
            first = e.old.strip().splitlines()[0]
            found = "does not contain" if n == 0 else f"contains {n} times (expected once)"
            raise PatchError(
                f"patch {patch.name} no longer applies: torchtitan/{patch.path} {found} the text it replaces, "
                f"{first!r}; the patch was written for torchtitan {TORCHTITAN_VERSION} (another release installed?)"
            )
    return "applicable"


def apply_patch(patch: Patch, text: str) -> str:
    """The text with the patch applied (unchanged when it already is); PatchError otherwise."""
    if patch_state(patch, text) == "applied":
        return text
    for e in _pending(patch, text):
        text = text.replace(e.old, e.new, 1)
    if patch_state(patch, text) != "applied":
        raise PatchError(f"patch {patch.name}: torchtitan/{patch.path} does not read as patched after the edit")
    return text


def apply_all(package_dir: Path, patches: tuple[Patch, ...] = PATCHES) -> list[tuple[str, str]]:
    """Apply every patch to the installed torchtitan package at `package_dir`; all of them are
    checked before any file is written. Returns (name, 'applied now' | 'already applied')."""
    package_dir = Path(package_dir)
    texts: dict[str, str] = {}
    states = []
    for p in patches:
        path = package_dir / p.path
        if not path.is_file():
            raise PatchError(f"patch {p.name}: torchtitan/{p.path} does not exist in {package_dir}")
        text = texts.get(p.path, path.read_text())
        states.append((p.name, "already applied" if patch_state(p, text) == "applied" else "applied now"))
        texts[p.path] = apply_patch(p, text)
    for rel, text in texts.items():
        try:
            compile(text, str(package_dir / rel), "exec")
        except SyntaxError as e:  # an edit that breaks the file is ours: write nothing
            raise PatchError(f"torchtitan/{rel} would not be valid Python once patched: {e}") from None
    for rel, text in texts.items():
        path = package_dir / rel
        if path.read_text() != text:
            atomic_write(path, text)
    return states
