"""A checkpoint folder on disk, without a process group: which steps are complete, reading and
checking one before it is loaded, and the single-process tools (full weights, Hugging Face
export / import). The Checkpointer (core/checkpoint.py) writes and loads through these.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import re
import shutil
import zlib
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from core.models.args import ModelArgs
from core.models.hf_convert import load_hf, save_hf

STEP_RE = re.compile(r"^step-(\d+)$")
TMP = ".tmp"
INFO = "titan.json"
METADATA = ".metadata"
MANIFEST = "manifest.json"  # per-file sizes and CRC32s, written last
CHUNK = 1 << 22
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# ModelArgs fields that fix parameter shapes: a checkpoint must agree on all of them.
SHAPE_FIELDS = ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "ffn_hidden_dim")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used; the message names the file."""


# ------------------------------------------------------------------------- DCP's exceptions
def _causes(e: BaseException) -> list[BaseException]:
    """The exceptions under a DCP CheckpointException (one per failed rank), else e itself."""
    if isinstance(e, CheckpointException):
        return [exc for exc, _ in e.failures.values()] or [e]
    return [e]


def _errno(e: BaseException) -> int | None:
    for c in _causes(e):
        while c is not None:
            if isinstance(c, OSError) and c.errno:
                return c.errno
            c = c.__cause__ or c.__context__
    return None


def _cause(e: BaseException) -> str:
    """One line: the first failing rank's exception (DCP's own text is a multi-rank traceback)."""
    c = _causes(e)[0]
    ranks = f" (ranks {sorted(e.failures)})" if isinstance(e, CheckpointException) else ""
    first = str(c).splitlines()[0] if str(c) else ""
    return f"{type(c).__name__}: {first}{ranks}"


def save_error(folder: Path, tmp: Path, step: int, what: str, e: BaseException, need: int) -> CheckpointError:
    """The one error of a failed save into `tmp` (removed by the caller): the cause and, for a full
    disk, the space a checkpoint needs (`need` bytes) and what is free; names the latest complete
    checkpoint of `folder`, which is kept."""
    latest = complete_steps(folder)
    kept = f"latest complete checkpoint kept: step-{max(latest)}" if latest else "no complete checkpoint"
    cause, free = _cause(e), shutil.disk_usage(folder if folder.exists() else folder.parent).free
    if _errno(e) == errno.ENOSPC or free < need:  # torch's zip writer may hide the errno
        cause = (
            f"no space left on device: a checkpoint needs about {need / 2**20:.1f} MiB, "
            f"{free / 2**20:.1f} MiB free on {folder} ({cause})"
        )
    return CheckpointError(f"{tmp}: checkpoint {what} of step {step} failed: {cause}; removed {tmp.name}, {kept}")


# ------------------------------------------------------------------------------------ folders
def complete_steps(folder: str | os.PathLike) -> dict[int, Path]:
    """{step: path} of the complete checkpoints in `folder` (renamed and with DCP metadata)."""
    folder, out = Path(folder), {}
    if folder.is_dir():
        for p in folder.iterdir():
            m = STEP_RE.match(p.name)
            if m and p.is_dir() and (p / METADATA).is_file():
                out[int(m.group(1))] = p
    return dict(sorted(out.items()))


def incomplete_steps(folder: str | os.PathLike) -> dict[int, Path]:
    """{step: path} of `step-N` folders (renamed, so once complete) that lack DCP metadata."""
    folder, out = Path(folder), {}
    if folder.is_dir():
        for p in folder.iterdir():
            m = STEP_RE.match(p.name)
            if m and p.is_dir() and not (p / METADATA).is_file():
                out[int(m.group(1))] = p
    return dict(sorted(out.items()))


def _crc32(path: Path) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            crc = zlib.crc32(chunk, crc)
    return crc


def write_manifest(folder: Path) -> int:
    """Record every file's size and CRC32 in `MANIFEST`, written last (through a temporary name)
    so that its presence means the rest was complete. Returns the folder's total bytes."""
    # the DCP files; titan.json is ours, checked as it is parsed, and may be edited or dropped
    files = {
        p.name: {"size": p.stat().st_size, "crc32": _crc32(p)}
        for p in sorted(folder.iterdir())
        if p.is_file() and p.name not in (MANIFEST, INFO)
    }
    tmp = folder / f"{MANIFEST}{TMP}"
    tmp.write_text(json.dumps({"algorithm": "crc32", "files": files}, indent=1) + "\n")
    os.replace(tmp, folder / MANIFEST)
    return sum(f["size"] for f in files.values()) + (folder / INFO).stat().st_size


def verify_manifest(path: Path) -> None:
    """Every file the manifest lists is there, of its size and CRC32; CheckpointError naming the
    first that is not. Checkpoints written before manifests existed (no file) pass."""
    f = path / MANIFEST
    if not f.is_file():
        if read_info(path).get("manifest"):
            raise CheckpointError(f"{f}: missing, though {INFO} says the checkpoint was saved with one")
        return
    try:
        files = json.loads(f.read_text())["files"]
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as e:
        raise CheckpointError(f"{f}: corrupted checkpoint manifest ({e})") from None
    for name, want in files.items():
        g = path / name
        if not g.is_file():
            raise CheckpointError(f"{g}: missing (listed in {MANIFEST})")
        size = g.stat().st_size
        if size != want["size"]:
            raise CheckpointError(f"{g}: {size} bytes, the manifest says {want['size']} (truncated or grown)")
        if _crc32(g) != want["crc32"]:
            raise CheckpointError(
                f"{g}: CRC32 mismatch at the same size ({size} bytes): the content changed "
                "after the save (disk or copy corruption)"
            )


def verify_before_load(path: Path) -> int:
    """verify_manifest, with how to go on from the previous step when it fails; the bytes on disk."""
    try:
        verify_manifest(path)
    except CheckpointError as e:
        raise CheckpointError(f"{e}; {damaged_hint(path, path.parent)}") from None
    return sum(f.stat().st_size for f in path.iterdir() if f.is_file())


def move_aside_if_damaged(final: Path) -> None:
    """A `step-N` without DCP metadata about to be replaced by a new save: kept aside, and said."""
    if final.exists() and not (final / METADATA).is_file():
        aside = final.with_name(f"{final.name}.damaged-{os.getpid()}")
        os.replace(final, aside)
        print(f"[checkpoint] {final} had no {METADATA} (damaged); moved to {aside}", flush=True)


def damaged_hint(path: Path, folder: Path) -> str:
    """How to go on without a damaged checkpoint: the previous complete step, if any."""
    older = [
        s
        for s in complete_steps(folder)
        if folder / f"step-{s}" != path and (not STEP_RE.match(path.name) or s < int(STEP_RE.match(path.name).group(1)))
    ]
    if not older:
        return f"no earlier complete checkpoint in {folder}; move {path.name} aside to start fresh"
    return (
        f"nothing was loaded or changed; to resume from step {older[-1]}, move it aside "
        f"(mv {path} {path}.damaged) or set checkpoint.load_step={older[-1]}"
    )


def is_checkpoint(path: str | os.PathLike) -> bool:
    return (Path(path) / METADATA).is_file()


def resolve(folder: Path, load_step: int = -1, resume_from: str = "") -> Path | None:
    """Which checkpoint a run loads: our own folder first (a restarted run continues from its
    own latest), then `resume_from` (a step folder, or a folder of them). None: start fresh."""
    own = complete_steps(folder)
    if load_step >= 0 and load_step in own:
        return own[load_step]
    newer = [p for s, p in incomplete_steps(folder).items() if load_step < 0 and s > max(own, default=-1)]
    if newer:  # never skipped (and later overwritten) without a word
        raise CheckpointError(
            f"{newer[-1] / METADATA}: missing: {newer[-1].name} is not a complete checkpoint "
            f"but newer than every complete one; {damaged_hint(newer[-1], folder)}"
        )
    if load_step < 0 and own:
        return own[max(own)]
    if resume_from:
        source = Path(resume_from)
        if not source.exists():
            raise CheckpointError(f"{source}: checkpoint.resume_from does not exist")
        if is_checkpoint(source):
            return source
        steps = complete_steps(source)
        if not steps:
            raise CheckpointError(
                f"{source}: checkpoint.resume_from holds no complete checkpoint (no {METADATA}, no step-N/{METADATA})"
            )
        if load_step < 0:
            return steps[max(steps)]
        if load_step in steps:
            return steps[load_step]
        raise CheckpointError(
            f"{source / f'step-{load_step}'}: checkpoint.load_step {load_step} not found "
            f"(complete checkpoints there: {sorted(steps)})"
        )
    if load_step >= 0:
        raise CheckpointError(
            f"{folder / f'step-{load_step}'}: checkpoint.load_step {load_step} not found "
            f"(complete checkpoints: {sorted(own) or 'none'})"
        )
    return None


def read_info(path: Path) -> dict:
    f = path / INFO
    if not f.is_file():
        return {}
    try:
        return json.loads(f.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{f}: corrupted checkpoint info ({e})") from None


def read_metadata(path: Path):
    """DCP metadata, or a CheckpointError naming the file."""
    f = path / METADATA
    if not f.is_file():
        raise CheckpointError(f"{f}: missing (not a complete DCP checkpoint)")
    try:
        return dcp.FileSystemReader(str(path)).read_metadata()
    except Exception as e:  # noqa: BLE001 - unpickling garbage raises anything from EOFError to KeyError
        raise CheckpointError(f"{f}: corrupted checkpoint metadata ({type(e).__name__}: {e})") from None


def check_files(path: Path, metadata) -> None:
    """Every shard file the metadata refers to exists and is long enough (catches a missing or
    truncated shard before any tensor is touched)."""
    need: dict[str, int] = {}
    for info in metadata.storage_data.values():
        need[info.relative_path] = max(need.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(need.items()):
        f = path / name
        if not f.is_file():
            raise CheckpointError(f"{f}: shard missing (the checkpoint is incomplete)")
        have = f.stat().st_size
        if have < size:
            raise CheckpointError(f"{f}: shard truncated ({have} bytes, the metadata needs {size})")


def model_shape(args) -> dict:
    return {k: getattr(args, k) for k in SHAPE_FIELDS}


def check_shapes(path: Path, metadata, state: dict, info: dict, args=None) -> None:
    """The checkpoint holds every tensor we load, with the same global shape."""
    if args is not None and info.get("model_shape"):
        ours, theirs = model_shape(args), info["model_shape"]
        diff = {k: (theirs.get(k), v) for k, v in ours.items() if theirs.get(k) != v}
        if diff:
            raise CheckpointError(
                f"{path / INFO}: checkpoint of another model shape: "
                + ", ".join(f"{k} {a} (checkpoint) != {b} (this run)" for k, (a, b) in diff.items())
            )
    stored = metadata.state_dict_metadata
    for key, value in _flatten(state).items():
        if key not in stored:
            raise CheckpointError(f"{path / METADATA}: has no entry {key!r} (a checkpoint of another model or layout?)")
        if isinstance(value, torch.Tensor):
            meta = stored[key]
            if not isinstance(meta, TensorStorageMetadata) or tuple(meta.size) != tuple(value.shape):
                got = tuple(meta.size) if isinstance(meta, TensorStorageMetadata) else "not a tensor"
                raise CheckpointError(
                    f"{path / METADATA}: {key} has shape {got}, this run needs "
                    f"{tuple(value.shape)} (a checkpoint of another model shape)"
                )


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


# ------------------------------------------------------------------- single-process tools
def load_model_weights(path: str | os.PathLike) -> tuple[dict[str, torch.Tensor], dict]:
    """The full (unsharded) model weights of a checkpoint, read in this process without a
    process group, and its titan.json. Works for any layout that wrote it."""
    path = Path(path)
    metadata = read_metadata(path)
    check_files(path, metadata)
    info = read_info(path)
    model = {
        k.removeprefix("model."): torch.empty(tuple(m.size), dtype=m.properties.dtype)
        for k, m in metadata.state_dict_metadata.items()
        if k.startswith("model.") and isinstance(m, TensorStorageMetadata)
    }
    if not model:
        raise CheckpointError(f"{path / METADATA}: no model weights in this checkpoint")
    state = {"model": model}
    dcp.load(state, checkpoint_id=str(path), no_dist=True)
    return state["model"], info


def _model_args_from_info(path: Path, info: dict):
    if not info.get("model_args"):
        raise CheckpointError(f"{path / INFO}: missing; cannot tell the model's configuration")
    return ModelArgs(**info["model_args"])


def export_hf(checkpoint: str | os.PathLike, out: str | os.PathLike, dtype: str = "float32") -> Path:
    """DCP checkpoint -> Hugging Face Llama folder (model.safetensors + config.json)."""
    checkpoint = Path(checkpoint)
    if not is_checkpoint(checkpoint) and complete_steps(checkpoint):  # a folder of steps: latest
        checkpoint = list(complete_steps(checkpoint).values())[-1]
    model, info = load_model_weights(checkpoint)
    args = _model_args_from_info(checkpoint, info)
    save_hf({k: v.to(DTYPES[dtype]) for k, v in model.items()}, args, str(out))
    return Path(out)


def import_hf(hf_folder: str | os.PathLike, out: str | os.PathLike, step: int = 0) -> Path:
    """Hugging Face Llama folder -> a model-only DCP checkpoint `out` (load it with
    checkpoint.resume_from=out). Written in one process; DCP reshards it for any layout."""
    out = Path(out)
    if out.exists():
        raise CheckpointError(f"{out}: already exists (not overwriting a checkpoint)")
    model, args = load_hf(str(hf_folder))
    tmp = out.with_name(out.name + TMP)
    shutil.rmtree(tmp, ignore_errors=True)
    dtypes = {v.dtype for v in model.values()}
    dcp.save({"model": model, "train_state": json.dumps({"step": step})}, checkpoint_id=str(tmp), no_dist=True)
    info = {
        "step": step,
        "kind": "model",
        "dtype": str(dtypes.pop()).removeprefix("torch.") if len(dtypes) == 1 else "mixed",
        "model_args": dataclasses.asdict(args),
        "model_shape": model_shape(args),
        "source": str(hf_folder),
        "torch": torch.__version__,
    }
    (tmp / INFO).write_text(json.dumps(info, indent=1) + "\n")
    os.replace(tmp, out)
    return out
