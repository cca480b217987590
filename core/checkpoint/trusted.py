"""Loading a checkpoint never runs what it reads: the one reader of a checkpoint's files.

torch 2.13's DCP reads `.metadata` with a plain `pickle.load` (FileSystemReader.read_metadata)
and every non-tensor item with `torch.load(weights_only=False)` (DefaultLoadPlanner.load_bytes),
so a checkpoint from someone else could run their code on every rank (pytorch/pytorch issue
189308, open upstream). Here:

- `.metadata` is unpickled by `MetadataUnpickler`, which admits only DCP's metadata types and
  plain values (`METADATA_TYPES`, found by listing every global a `.metadata` of this project
  references; plain containers and scalars are pickle opcodes and need no global);
- a non-tensor item is read with `torch.load(weights_only=True)` and must be a plain value
  (`PLAIN`: what this project saves there: ints, floats, strings, bools, None, tuples, and the
  containers of JSON);
- tensors DCP already reads with `weights_only=True` (FileSystemReader.read_data); a refusal
  there is said the same way.

Anything else is refused (a global outside the allowlists before it is imported or called):
`RefusedCheckpoint`, one line naming the file and the type. Every load goes through `load`
(and `.metadata` alone through `read_metadata`)."""

from __future__ import annotations

import collections
import io
import os
import pathlib
import pickle
import re
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import filesystem, metadata
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem

from core.checkpoint.folder import CheckpointError

WHY = "not a checkpoint type; the file may run code: do not load checkpoints you do not trust"


class RefusedCheckpoint(CheckpointError):
    """A checkpoint file that names a type outside the allowlists: it is never built."""


def refused(file: str | os.PathLike, what: str) -> RefusedCheckpoint:
    return RefusedCheckpoint(f"{file}: refused to load {what!r} ({WHY})")


# ------------------------------------------------------------------------------- .metadata
def _by_name(*objs: Any) -> dict[tuple[str, str], Any]:
    return {(o.__module__, o.__qualname__): o for o in objs}


def _metadata_types() -> dict[tuple[str, str], Any]:
    """(module, name) -> object, every global a DCP `.metadata` of torch 2.13 references: its
    dataclasses, torch.Size (offsets, sizes), dtypes, the layout (pickled through
    torch.serialization._get_layout, a lookup of torch's layouts), the memory-format enum, and
    the PosixPath of StorageMeta.checkpoint_id. Calling any of them builds a value, nothing more."""
    md = metadata
    types = _by_name(
        md.Metadata,
        md.StorageMeta,
        md.TensorStorageMetadata,
        md.BytesStorageMetadata,
        md.ChunkStorageMetadata,
        md.TensorProperties,
        md.MetadataIndex,
        md._MEM_FORMAT_ENCODING,
        filesystem._StorageInfo,
        torch.Size,
        torch.serialization._get_layout,
        collections.OrderedDict,
        set,  # pickle protocols < 4 build sets by calling the type
        frozenset,
    )
    types |= {("torch", name): v for name, v in vars(torch).items() if isinstance(v, torch.dtype)}
    # a path pickles under its class's module: `pathlib` up to Python 3.12, `pathlib._local` after
    for cls in (pathlib.PosixPath, pathlib.PurePosixPath):
        types[("pathlib", cls.__name__)] = types[("pathlib._local", cls.__name__)] = cls
    return types


METADATA_TYPES = _metadata_types()


class MetadataUnpickler(pickle.Unpickler):
    """pickle's own restricted unpickler (the "Restricting Globals" recipe of its docs): a global
    outside METADATA_TYPES is refused before anything is imported or called."""

    def __init__(self, file, where: str | os.PathLike):
        super().__init__(file)
        self.where = where

    def find_class(self, module: str, name: str) -> Any:
        found = METADATA_TYPES.get((module, name))
        if found is None:
            raise refused(self.where, f"{module}.{name}")
        return found


class TrustedReader(filesystem.FileSystemReader):
    """DCP's FileSystemReader with `.metadata` read by MetadataUnpickler; its non-tensor items
    reach only a TrustedPlanner (DCP hands them to the planner's `load_bytes`)."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> metadata.Metadata:
        # torch's read_metadata with the unpickler swapped (its other lines as they are there)
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as f:
            md = MetadataUnpickler(f, path).load()
        if not isinstance(md, metadata.Metadata):
            raise CheckpointError(f"{path}: not DCP metadata (a pickled {type(md).__name__})")
        meta = getattr(md, "storage_meta", None) or metadata.StorageMeta()
        meta.load_id = self.load_id
        md.storage_meta = meta
        return md

    def _slice_file(self, file, sinfo: filesystem._StorageInfo):
        self._reading = sinfo.relative_path  # the file an item comes from, for a refusal to name
        return super()._slice_file(file, sinfo)

    def read_data(self, plan: LoadPlan, planner: LoadPlanner):
        if not isinstance(planner, TrustedPlanner):  # DCP's default planner unpickles items whole
            raise TypeError("TrustedReader reads a checkpoint through core.checkpoint.trusted.load only")
        try:
            return super().read_data(plan, planner)
        except pickle.UnpicklingError as e:  # a tensor item torch's own weights-only load refused
            where = Path(self.path) / getattr(self, "_reading", "(a shard)")
            raise refused(where, _named_in(str(e))) from None


# ------------------------------------------------------------------------ non-tensor items
PLAIN = (type(None), bool, int, float, str, bytes, tuple, list, dict)


def _foreign(value: Any) -> str | None:
    """The first type in `value` that is not PLAIN (exact types: a subclass may carry code)."""
    todo = [value]
    while todo:
        v = todo.pop()
        if type(v) not in PLAIN:
            return f"{type(v).__module__}.{type(v).__qualname__}"
        if isinstance(v, (tuple, list)):
            todo.extend(v)
        elif isinstance(v, dict):
            todo.extend(v.keys())
            todo.extend(v.values())
    return None


def _named_in(message: str) -> str:
    """What torch's weights-only unpickler refused, from its (multi-line) message."""
    m = re.search(r"GLOBAL (\S+) (?:was not an allowed global|whose module)", message)
    if m:
        return m.group(1)
    m = re.search(r"WeightsUnpickler error: (.+)", message)
    return m.group(1).strip() if m else message.strip().splitlines()[-1]


def load_plain(raw: io.BytesIO, where: str | Path) -> Any:
    """A non-tensor item: torch.load(weights_only=True) (explicit, so no environment variable
    turns it off), then only PLAIN values."""
    try:
        value = torch.load(raw, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        raise refused(where, _named_in(str(e))) from None
    bad = _foreign(value)
    if bad is not None:
        raise refused(where, bad)
    return value


class TrustedPlanner(DefaultLoadPlanner):
    """DCP's default load planner whose non-tensor items are read by `load_plain`."""

    def __init__(self, folder: str | Path):
        super().__init__()
        self.folder = Path(folder)

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        # DefaultLoadPlanner.load_bytes with its torch.load(weights_only=False) replaced
        assert self.metadata is not None  # set_up_planner ran
        where = self.folder / self.metadata.storage_data[read_item.storage_index].relative_path
        obj = load_plain(value, where)
        fqn = read_item.dest_index.fqn
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj


def read_metadata(path: str | Path) -> metadata.Metadata:
    """A checkpoint folder's `.metadata`, read by MetadataUnpickler."""
    return TrustedReader(str(path)).read_metadata()


def load(state: dict, path: str | Path, process_group=None, no_dist: bool = False) -> None:
    """dcp.load through TrustedReader and TrustedPlanner: the project's only load of a checkpoint."""
    dcp.load(
        state,
        storage_reader=TrustedReader(str(path)),
        planner=TrustedPlanner(path),
        process_group=process_group,
        no_dist=no_dist,
    )
