"""A checkpoint's contents, without a process group: DCP's errors in one line, its metadata and
shards checked before anything is loaded, and the single-process tools (full weights, Hugging
Face export / import, and `main`: their command line, `python -m core.checkpoint`). The folder's
layout and names: core/checkpoint/folder.py. Every read of a checkpoint's files goes through
core/checkpoint/trusted.py (loading never runs what it reads)."""

from __future__ import annotations

import argparse
import dataclasses
import errno
import os
import shutil
import sys
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from core.checkpoint.folder import (
    INFO,
    METADATA,
    TMP,
    CheckpointError,
    complete_steps,
    is_checkpoint,
    read_info,
    rename_complete,
)
from core.checkpoint.trusted import RefusedCheckpoint
from core.checkpoint.trusted import load as trusted_load
from core.checkpoint.trusted import read_metadata as trusted_metadata
from core.config import flatten_keys
from core.fileio import atomic_write_json
from core.models.args import ModelArgs, model_shape
from core.models.hf_convert import load_hf, save_hf
from core.noise import quiet_library_warnings

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# ModelArgs fields that fix parameter shapes: a checkpoint must agree on all of them.


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
    code = _errno(e)
    if code == errno.ENOSPC or (code is None and free < need):  # torch's zip writer may hide the errno
        cause = (
            f"no space left on device: a checkpoint needs about {need / 2**20:.1f} MiB, "
            f"{free / 2**20:.1f} MiB free on {folder} ({cause})"
        )
    return CheckpointError(f"{tmp}: checkpoint {what} of step {step} failed: {cause}; removed {tmp.name}, {kept}")


def load_error(path: Path, e: BaseException) -> CheckpointError:
    """The one error of a failed DCP load of `path`: a refused file as it was said (it names the
    file and the type), else the first failing rank's cause."""
    refusals = [c for c in _causes(e) if isinstance(c, RefusedCheckpoint)]
    return refusals[0] if refusals else CheckpointError(f"{path}: DCP load failed: {_cause(e)}")


def read_metadata(path: Path):
    """DCP metadata, or a CheckpointError naming the file (RefusedCheckpoint: a type outside the
    allowlist, core/checkpoint/trusted.py)."""
    f = path / METADATA
    if not f.is_file():
        raise CheckpointError(f"{f}: missing (not a complete DCP checkpoint)")
    try:
        return trusted_metadata(path)
    except CheckpointError:
        raise
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
    for key, value in flatten_keys(state).items():
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
    try:
        trusted_load(state, path, no_dist=True)
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - DCP raises anything; CheckpointException is a BaseException
        raise load_error(path, e) from None
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
    state = {"model": model, "train_state": {"step": step}}  # the keys core/checkpoint/state.py writes
    dcp.save(state, checkpoint_id=str(tmp), no_dist=True)
    info = {
        "step": step,
        "kind": "model",
        "dtype": str(dtypes.pop()).removeprefix("torch.") if len(dtypes) == 1 else "mixed",
        "model_args": dataclasses.asdict(args),
        "model_shape": model_shape(args),
        "source": str(hf_folder),
        "torch": torch.__version__,
    }
    atomic_write_json(tmp / INFO, info, indent=1)
    rename_complete(tmp, out)
    return out


# ------------------------------------------------------------------------------------ CLI
def main(argv: list[str] | None = None) -> int:
    """`python -m core.checkpoint`: the single-process tools on the command line."""
    parser = argparse.ArgumentParser(
        prog="python -m core.checkpoint", description="DCP checkpoints: Hugging Face export and import, listing"
    )
    sub = parser.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("export-hf", help="DCP checkpoint (step folder, or a folder of them: latest) -> HF Llama")
    e.add_argument("checkpoint")
    e.add_argument("out")
    e.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    i = sub.add_parser("import-hf", help="HF Llama folder -> model-only DCP checkpoint")
    i.add_argument("hf_folder")
    i.add_argument("out")
    ls = sub.add_parser("ls", help="complete checkpoints of a folder")
    ls.add_argument("folder")
    a = parser.parse_args(argv)
    quiet_library_warnings()
    try:
        if a.cmd == "export-hf":
            print(export_hf(a.checkpoint, a.out, a.dtype))
        elif a.cmd == "import-hf":
            print(import_hf(a.hf_folder, a.out))
        else:
            for step, path in complete_steps(a.folder).items():
                info = read_info(path)
                print(f"{step:>8}  {info.get('kind', '?'):5}  {info.get('dtype', '?'):8}  {path}")
    except (CheckpointError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0
