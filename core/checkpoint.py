"""Distributed checkpoints with torch.distributed.checkpoint (DCP): save, async save, resume,
resharding, keep-latest-k, model-only export, seed checkpoint, Hugging Face interchange.

Folder layout (`<job.output_dir>/<checkpoint.folder>/`)::

    step-N/        a complete checkpoint: DCP shards (`__R_0.distcp`), `.metadata`, `titan.json`
    step-N.tmp/    being written, or left by a run killed mid-save: never loaded, removed at start

A checkpoint is written into `step-N.tmp` and renamed to `step-N` by rank 0 only once DCP has
finished on every rank (DCP's coordinator writes `.metadata` after all ranks reported their
writes, then every rank's `save` returns), so "latest" is always a complete checkpoint.

What is saved (DCP flattens the nested keys):

    model.<fqn>                      parameters (DTensors under FSDP/TP: DCP reshards on load)
    optimizer.state.<fqn>.<name>     flattened optimizer state (one key space for every PP split)
    optimizer.param_groups.<fqn>.<k>
    lr_scheduler                     JSON of the scheduler's state_dict
    train_state                      JSON: step, layout, world size
    dataloader.dp_rank_<r>           JSON of dp rank r's loader state (the TokenWindowLoader's
                                     state is its position in the one global stream, so any
                                     rank's copy resumes any DP degree)
    rng.rank_<R>                     torch RNG state of global rank R (restored on the same layout)

CLI: `python -m core.checkpoint export-hf CKPT OUT [--dtype bfloat16]`, `import-hf HF OUT`,
`ls FOLDER`.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_state_dict, set_model_state_dict,
                                                     set_state_dict)

STEP_RE = re.compile(r"^step-(\d+)$")
TMP = ".tmp"
INFO = "titan.json"
METADATA = ".metadata"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# ModelArgs fields that fix parameter shapes: a checkpoint must agree on all of them.
SHAPE_FIELDS = ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "ffn_hidden_dim")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used; the message names the file."""


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


def is_checkpoint(path: str | os.PathLike) -> bool:
    return (Path(path) / METADATA).is_file()


def resolve(folder: Path, load_step: int = -1, resume_from: str = "") -> Path | None:
    """Which checkpoint a run loads: our own folder first (a restarted run continues from its
    own latest), then `resume_from` (a step folder, or a folder of them). None: start fresh."""
    own = complete_steps(folder)
    if load_step >= 0 and load_step in own:
        return own[load_step]
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
            raise CheckpointError(f"{source}: checkpoint.resume_from holds no complete checkpoint "
                                  f"(no {METADATA}, no step-N/{METADATA})")
        if load_step < 0:
            return steps[max(steps)]
        if load_step in steps:
            return steps[load_step]
        raise CheckpointError(f"{source / f'step-{load_step}'}: checkpoint.load_step {load_step} not found "
                              f"(complete checkpoints there: {sorted(steps)})")
    if load_step >= 0:
        raise CheckpointError(f"{folder / f'step-{load_step}'}: checkpoint.load_step {load_step} not found "
                              f"(complete checkpoints: {sorted(own) or 'none'})")
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
    except Exception as e:  # unpickling garbage raises anything from EOFError to KeyError
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
            raise CheckpointError(f"{path / INFO}: checkpoint of another model shape: " + ", ".join(
                f"{k} {a} (checkpoint) != {b} (this run)" for k, (a, b) in diff.items()))
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    stored = metadata.state_dict_metadata
    for key, value in _flatten(state).items():
        if key not in stored:
            raise CheckpointError(f"{path / METADATA}: has no entry {key!r} "
                                  "(a checkpoint of another model or layout?)")
        if isinstance(value, torch.Tensor):
            meta = stored[key]
            if not isinstance(meta, TensorStorageMetadata) or tuple(meta.size) != tuple(value.shape):
                got = tuple(meta.size) if isinstance(meta, TensorStorageMetadata) else "not a tensor"
                raise CheckpointError(f"{path / METADATA}: {key} has shape {got}, this run needs "
                                      f"{tuple(value.shape)} (a checkpoint of another model shape)")


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


# ------------------------------------------------------------- model parts <-> one key space
def _strip_model(key: str) -> str:
    return key.split(".", 1)[1]  # "<part>.<fqn>" -> "<fqn>"


def _strip_optim(key: str) -> str:
    kind, _, rest = key.split(".", 2)  # "state.<part>.<fqn>.<name>" -> "state.<fqn>.<name>"
    return f"{kind}.{rest}"


class _Parts:
    """The model parts of this rank (one, or several pipeline stages) under one optimizer.

    get_state_dict needs a module holding every parameter of the optimizer: a ModuleList of the
    parts, whose index prefix is stripped so that keys are the whole model's FQNs on every
    layout (pipeline splitting keeps FQNs)."""

    OPTS = StateDictOptions(flatten_optimizer_state_dict=True)

    def __init__(self, model_parts: list[nn.Module], optimizer):
        self.wrap = nn.ModuleList(model_parts)
        self.optimizer = optimizer

    def model_state(self) -> tuple[dict, dict]:
        sd = get_model_state_dict(self.wrap)
        names = {_strip_model(k): k for k in sd}
        return {n: sd[k] for n, k in names.items()}, names

    def full_state(self) -> tuple[dict, dict, dict, dict]:
        msd, osd = get_state_dict(self.wrap, self.optimizer, options=self.OPTS)
        mnames = {_strip_model(k): k for k in msd}
        onames = {_strip_optim(k): k for k in osd}
        if len(mnames) != len(msd) or len(onames) != len(osd):
            raise RuntimeError("two model parts share a parameter name")
        return ({n: msd[k] for n, k in mnames.items()}, mnames,
                {n: osd[k] for n, k in onames.items()}, onames)

    def set_model(self, model: dict, names: dict) -> None:
        set_model_state_dict(self.wrap, {names[n]: v for n, v in model.items()})

    def set_full(self, model: dict, mnames: dict, optim: dict, onames: dict) -> None:
        set_state_dict(self.wrap, self.optimizer,
                       model_state_dict={mnames[n]: v for n, v in model.items()},
                       optim_state_dict={onames[n]: v for n, v in optim.items()}, options=self.OPTS)


# ------------------------------------------------------------------------------- checkpointer
class Checkpointer:
    """Owns `<output_dir>/<checkpoint.folder>` for one run of the Trainer.

    `load()` before the loop, `maybe_save(step)` after each step, `close()` at the end.
    Async modes (checkpoint.async_mode):
      async                  dcp.async_save in a thread on its own gloo group: the loop blocks
                             only while the state is copied to CPU memory.
      async_with_pinned_mem  the copy itself runs in the background (torch's DefaultStager,
                             buffers allocated once and reused; pinned on CUDA) and the upload
                             in a separate process; the next optimizer step waits for the copy.
                             On CPU there is no pinned memory (DefaultStager needs CUDA for it and
                             for non-blocking copies): the copy is a background memcpy into the
                             reused buffers, which still takes it off the training thread.
    """

    def __init__(self, trainer):
        self.trainer = trainer
        self.cfg = trainer.cfg
        c = self.cfg.checkpoint
        self.folder = Path(self.cfg.job.output_dir) / c.folder
        self.rank = dist.get_rank()
        self.interval = c.interval
        self.keep_latest_k = c.keep_latest_k
        self.async_mode = c.async_mode
        self.parts = _Parts(trainer.model_parts, trainer.optimizer)
        self.pending: dict | None = None  # the async save in flight
        self.stats: list[dict] = []  # per save: step, mode, blocking_s, total_s
        self.pg = None
        self.stager = None
        if self.async_mode != "disabled":
            # Its own gloo group: the background save's collectives never queue behind (or
            # interleave with) the training collectives, and it works beside NCCL.
            import datetime
            self.pg = dist.new_group(backend="gloo", timeout=datetime.timedelta(
                seconds=self.cfg.comm.init_timeout_seconds))
        if self.async_mode == "async_with_pinned_mem":
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
            cuda = torch.cuda.is_available()
            self.stager = DefaultStager(StagingOptions(use_pinned_memory=cuda, use_shared_memory=True,
                                                       use_async_staging=True, use_non_blocking_copy=cuda))
            # The background copy must finish before parameters change.
            self._hook = trainer.optimizer.register_step_pre_hook(lambda *_: self.maybe_wait_for_staging())

    # ---------------------------------------------------------------------------------- load
    def load(self) -> bool:
        """Restore the latest complete checkpoint (or checkpoint.load_step / resume_from).
        Returns whether anything was loaded. Nothing on disk is modified except stale
        `step-N.tmp` folders of a run killed mid-save."""
        c = self.cfg.checkpoint
        path = None
        error = None
        if self.rank == 0:
            for stale in self.folder.glob(f"step-*{TMP}") if self.folder.is_dir() else []:
                shutil.rmtree(stale, ignore_errors=True)
            try:
                path = resolve(self.folder, c.load_step, c.resume_from)
            except CheckpointError as e:
                error = str(e)
        # rank 0 decides for everyone (they must all load the same step)
        box = [path, error]
        dist.broadcast_object_list(box, src=0)
        path, error = box
        if error:
            raise CheckpointError(error)
        if path is None:
            if c.create_seed_checkpoint:
                self.save(0, seed=True)
            return False
        t0 = time.perf_counter()
        step = self._load(Path(path))
        if self.rank == 0:
            print(f"[checkpoint] loaded {path} (step {step}) in {time.perf_counter() - t0:.2f} s", flush=True)
        return True

    def _load(self, path: Path) -> int:
        metadata = read_metadata(path)
        check_files(path, metadata)
        info = read_info(path)
        stored = metadata.state_dict_metadata
        full = any(k.startswith("optimizer.") for k in stored)
        if full:
            model, mnames, optim, onames = self.parts.full_state()
            state: dict[str, Any] = {"model": model, "optimizer": optim, "lr_scheduler": ""}
        else:
            model, mnames = self.parts.model_state()
            state = {"model": model}
        check_shapes(path, metadata, state, info, getattr(self.trainer, "model_args", None))
        # Weights nobody here loads mean another model (a deeper one shares our first layers);
        # a pipeline stage loads a subset, so compare with the union over all ranks.
        names = [None] * dist.get_world_size()
        dist.all_gather_object(names, sorted(model))
        extra = sorted({k.removeprefix("model.") for k in stored if k.startswith("model.")}
                       - set().union(*map(set, names)))
        if extra:
            raise CheckpointError(f"{path / METADATA}: holds {len(extra)} model entries this model lacks "
                                  f"({', '.join(extra[:3])}{', ...' if len(extra) > 3 else ''}): "
                                  "a checkpoint of another model shape")
        if "train_state" in stored:
            state["train_state"] = ""
        dp_key = self._dataloader_key(stored, info)
        if full and dp_key:
            state["dataloader"] = {dp_key: ""}
        elif full and self.rank == 0:
            print(f"[checkpoint] warning: {path} has no data-loader state; the data restarts from "
                  "the beginning", flush=True)
        rng_key = f"rng.rank_{self.rank}"
        same_layout = info.get("layout") == self._layout()
        if full and same_layout and rng_key in stored:
            state["rng"] = {f"rank_{self.rank}": torch.get_rng_state()}
        try:
            dcp.load(state, checkpoint_id=str(path))
        except Exception as e:
            raise CheckpointError(f"{path}: DCP load failed: {type(e).__name__}: {e}") from e
        step = 0
        if "train_state" in state:
            step = int(json.loads(state["train_state"])["step"])
        if full:
            self.parts.set_full(state["model"], mnames, state["optimizer"], onames)
            self.trainer.lr_scheduler.load_state_dict(json.loads(state["lr_scheduler"]))
            if "dataloader" in state:
                self.trainer.dataloader.load_state_dict(json.loads(state["dataloader"][dp_key]))
            if "rng" in state:
                torch.set_rng_state(state["rng"][f"rank_{self.rank}"])
            self.trainer.step = step
        else:
            # weights only (seed, HF import, final export): a new run starts from them at step 0,
            # but our own final export means this run is done
            self.parts.set_model(state["model"], mnames)
            if path.parent == self.folder:
                self.trainer.step = step
        return step

    def _dataloader_key(self, stored: dict, info: dict) -> str | None:
        dp_rank = self.trainer.mesh["dp"].get_local_rank()
        mine = f"dp_rank_{dp_rank}"
        if info.get("dp_degree") == self.trainer.mesh["dp"].size() and f"dataloader.{mine}" in stored:
            return mine
        # another DP degree: the loader's state is its place in the global stream, the same
        # on every rank, so rank 0's copy serves any degree
        return "dp_rank_0" if "dataloader.dp_rank_0" in stored else None

    def _layout(self) -> dict:
        p = self.cfg.parallelism
        return {"pp": p.pp, "dp_replicate": p.dp_replicate, "dp_shard": p.dp_shard, "cp": p.cp,
                "tp": p.tp, "world_size": dist.get_world_size()}

    # ---------------------------------------------------------------------------------- save
    def maybe_save(self, step: int) -> None:
        self._poll()
        last = step == self.cfg.training.steps
        if step % self.interval == 0 or last:
            self.save(step, last=last)

    def _state(self, step: int, model_only: bool, dtype: torch.dtype | None) -> dict:
        t = self.trainer
        info = {"step": step, "layout": self._layout()}
        if model_only:
            model, _ = self.parts.model_state()
            if dtype is not None:
                model = {k: v.to(dtype) for k, v in model.items()}
            return {"model": model, "train_state": json.dumps(info)}
        model, _, optim, _ = self.parts.full_state()
        dp = t.mesh["dp"]
        # JSON strings: small, copied now (the loader moves on while an async save runs)
        return {
            "model": model,
            "optimizer": optim,
            "lr_scheduler": json.dumps(t.lr_scheduler.state_dict()),
            "train_state": json.dumps(info),
            "dataloader": {f"dp_rank_{dp.get_local_rank()}": json.dumps(t.dataloader.state_dict())},
            "rng": {f"rank_{self.rank}": torch.get_rng_state()},
        }

    def _info(self, step: int, kind: str, dtype: str) -> dict:
        args = getattr(self.trainer, "model_args", None)
        return {
            "step": step,
            "kind": kind,  # full | model (weights only) | seed
            "dtype": dtype,
            "model_args": dataclasses.asdict(args) if args is not None else None,
            "model_shape": model_shape(args) if args is not None else None,
            "flavor": self.cfg.model.flavor,
            "layout": self._layout(),
            "dp_degree": self.trainer.mesh["dp"].size(),
            "torch": torch.__version__,
        }

    @torch.no_grad()
    def save(self, step: int, last: bool = False, seed: bool = False) -> None:
        # one save in flight at a time (the wait counts for that save, except the end-of-run one)
        self._wait_pending(in_loop=not last)
        t0 = time.perf_counter()
        c = self.cfg.checkpoint
        model_only = seed or (last and c.model_weights_only)
        dtype = DTYPES[c.export_dtype] if model_only and not seed else None
        state = self._state(step, model_only, dtype)
        kind = "seed" if seed else "model" if model_only else "full"
        info = self._info(step, kind, c.export_dtype if dtype else "float32")
        tmp = self.folder / f"step-{step}{TMP}"
        if self.rank == 0:
            self.folder.mkdir(parents=True, exist_ok=True)
        # The last save has nothing left to overlap with: synchronous.
        if self.async_mode == "disabled" or last or seed:
            dcp.save(state, checkpoint_id=str(tmp))
            self._finalize(step, tmp, info)
            dt = time.perf_counter() - t0
            self.stats.append({"step": step, "mode": "sync", "blocking_s": dt, "wait_s": 0.0, "total_s": dt})
            return
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
        if self.async_mode == "async":
            upload = dcp.async_save(state, checkpoint_id=str(tmp), process_group=self.pg)
            staging = None
        else:
            resp = dcp.async_save(state, checkpoint_id=str(tmp), process_group=self.pg,
                                  async_checkpointer_type=AsyncCheckpointerType.PROCESS,
                                  async_stager=self.stager)
            upload, staging = resp.upload_completion, resp.staging_completion
        p = self.pending = {"step": step, "tmp": tmp, "info": info, "upload": upload, "staging": staging,
                            "t0": t0, "blocking_s": time.perf_counter() - t0}
        upload.add_done_callback(lambda _: p.setdefault("done_at", time.perf_counter()))

    def maybe_wait_for_staging(self) -> None:
        p = self.pending
        if p is not None and p["staging"] is not None:
            t0 = time.perf_counter()
            p["staging"].result()
            p["staging"] = None
            p["blocking_s"] += time.perf_counter() - t0

    def _poll(self) -> None:
        if self.pending is not None and self.pending["upload"].done():
            self._wait_pending()

    def _wait_pending(self, in_loop: bool = True) -> None:
        p, self.pending = self.pending, None
        if p is None:
            return
        t0 = time.perf_counter()
        if p["staging"] is not None:
            p["staging"].result()
        try:
            p["upload"].result()
        except Exception as e:
            raise CheckpointError(f"{p['tmp']}: async save failed: {type(e).__name__}: {e}") from e
        if in_loop:  # the end-of-run flush is not loop time
            p["wait_s"] = time.perf_counter() - t0  # the next save waited for this upload
            p["blocking_s"] += p["wait_s"]
        self._finalize(p["step"], p["tmp"], p["info"])
        self.stats.append({"step": p["step"], "mode": self.async_mode, "blocking_s": p["blocking_s"],
                           "wait_s": p.get("wait_s", 0.0),
                           "total_s": p.get("done_at", time.perf_counter()) - p["t0"]})

    def _finalize(self, step: int, tmp: Path, info: dict) -> None:
        """Rank 0, after DCP finished on every rank: mark complete by an atomic rename."""
        if self.rank != 0:
            return
        (tmp / INFO).write_text(json.dumps(info, indent=1) + "\n")
        final = self.folder / f"step-{step}"
        if final.exists():  # a re-run of the same step (load_step into the past): replace it
            old = self.folder / f"step-{step}.old{TMP}"
            os.replace(final, old)
            os.replace(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, final)
        self._purge()

    def _purge(self) -> None:
        """keep_latest_k: drop the oldest complete checkpoints (the step-0 seed is kept)."""
        if self.keep_latest_k <= 0:
            return
        steps = [s for s in complete_steps(self.folder) if s > 0]
        for s in steps[:-self.keep_latest_k]:
            shutil.rmtree(self.folder / f"step-{s}", ignore_errors=True)

    def close(self) -> None:
        """Wait for the save in flight and release the background resources."""
        try:
            self._wait_pending(in_loop=False)
        finally:
            if self.stager is not None:
                self._hook.remove()
                self.stager.close()
                self.stager = None


# ----------------------------------------------------------------- single-process tools + CLI
def load_model_weights(path: str | os.PathLike) -> tuple[dict[str, torch.Tensor], dict]:
    """The full (unsharded) model weights of a checkpoint, read in this process without a
    process group, and its titan.json. Works for any layout that wrote it."""
    path = Path(path)
    metadata = read_metadata(path)
    check_files(path, metadata)
    info = read_info(path)
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    model = {k.removeprefix("model."): torch.empty(tuple(m.size), dtype=m.properties.dtype)
             for k, m in metadata.state_dict_metadata.items()
             if k.startswith("model.") and isinstance(m, TensorStorageMetadata)}
    if not model:
        raise CheckpointError(f"{path / METADATA}: no model weights in this checkpoint")
    state = {"model": model}
    dcp.load(state, checkpoint_id=str(path), no_dist=True)
    return state["model"], info


def _model_args_from_info(path: Path, info: dict):
    from core.models.llama3 import ModelArgs
    if not info.get("model_args"):
        raise CheckpointError(f"{path / INFO}: missing; cannot tell the model's configuration")
    return ModelArgs(**info["model_args"])


def export_hf(checkpoint: str | os.PathLike, out: str | os.PathLike, dtype: str = "float32") -> Path:
    """DCP checkpoint -> Hugging Face Llama folder (model.safetensors + config.json)."""
    from core.models.hf_convert import save_hf
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
    from core.models.hf_convert import load_hf
    out = Path(out)
    if out.exists():
        raise CheckpointError(f"{out}: already exists (not overwriting a checkpoint)")
    model, args = load_hf(str(hf_folder))
    tmp = out.with_name(out.name + TMP)
    shutil.rmtree(tmp, ignore_errors=True)
    dtypes = {v.dtype for v in model.values()}
    dcp.save({"model": model, "train_state": json.dumps({"step": step})}, checkpoint_id=str(tmp),
             no_dist=True)
    info = {"step": step, "kind": "model", "dtype": str(dtypes.pop()).removeprefix("torch.") if len(dtypes) == 1
            else "mixed", "model_args": dataclasses.asdict(args), "model_shape": model_shape(args),
            "source": str(hf_folder), "torch": torch.__version__}
    (tmp / INFO).write_text(json.dumps(info, indent=1) + "\n")
    os.replace(tmp, out)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m core.checkpoint", description=__doc__.splitlines()[0])
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


if __name__ == "__main__":
    sys.exit(main())
