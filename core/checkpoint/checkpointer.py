"""Distributed checkpoints with torch.distributed.checkpoint (DCP): save, async save, resume,
resharding, keep-latest-k, model-only export, seed checkpoint, Hugging Face interchange.

Folder layout (`<job.output_dir>/<checkpoint.folder>/`)::

    step-N/        a complete checkpoint: DCP shards (`__R_0.distcp`), `.metadata`, `titan.json`
    step-N.tmp/    being written, or left by a run killed mid-save: never loaded, removed at start

A checkpoint is written into `step-N.tmp` and renamed to `step-N` by rank 0 only once DCP has
finished on every rank (DCP's coordinator writes `.metadata` after all ranks reported their
writes, then every rank's `save` returns) and every rank has checksummed the files it wrote into
the manifest, so "latest" is always a complete checkpoint. Before a load, every rank verifies a
share of the files. Every checkpoint collective runs on the checkpoint's own gloo group, with
`comm.checkpoint_timeout_seconds` (core/checkpoint/collectives.py).

What is saved: core/checkpoint/state.py (one `Stateful` per kind of state, and the keys on disk).

The Checkpointer is given what it saves (model parts, optimizer, LR scheduler, data loader, a
`TrainState`) and hands DCP their `Stateful` views, which restore them in place; folder and file
checks, error messages and the single-process tools are core/checkpoint/files.py.

CLI (core/checkpoint/files.py `main`, core/checkpoint/__main__.py): `python -m core.checkpoint export-hf CKPT OUT
[--dtype bfloat16]`, `import-hf HF OUT`, `ls FOLDER`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import shutil
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import NoReturn

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
from torch.distributed.checkpoint.stateful import Stateful

from core.checkpoint.collectives import (
    SaveProgress,
    all_done,
    checkpoint_group,
    gather_checksums,
    own_checksums,
    slowest,
    verification_plan,
    verify_everywhere,
)
from core.checkpoint.files import (
    DTYPES,
    CheckpointException,
    check_files,
    check_shapes,
    load_error,
    model_shape,
    read_metadata,
    save_error,
)
from core.checkpoint.folder import (
    INFO,
    MANIFEST,
    METADATA,
    CheckpointError,
    folder_bytes,
    move_later_aside,
    publish,
    purge,
    read_info,
    resolve,
    stale_tmp_dirs,
    tmp_dir,
)
from core.checkpoint.manifest import write_manifest
from core.checkpoint.state import JsonState, ModelParts, ModelState, OptimizerState, RngState, dataloader_key
from core.checkpoint.trusted import load as trusted_load
from core.config import JobConfig
from core.fileio import atomic_write_json
from core.logs import get_logger
from core.models.args import ModelArgs

log = get_logger(__name__)


@contextlib.contextmanager
def dcp_errors(on_error: Callable[[BaseException], NoReturn]):
    """Hand whatever a DCP call raises to `on_error`, which raises the project's own error."""
    try:
        yield
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - DCP raises anything; CheckpointException is a BaseException
        on_error(e)


def _raise(e: BaseException) -> NoReturn:
    raise e from None


# ------------------------------------------------------------------------------- checkpointer
class Checkpointer:
    """Owns `<output_dir>/<checkpoint.folder>` for one run: saves and restores the objects it is
    given (this rank's model parts, the optimizer, the LR scheduler, the data loader, the train
    state); loading restores them in place (each stateful object loads its own state).

    `load()` before the loop, `maybe_save(step)` after each step, `close()` at the end.
    Async modes (checkpoint.async_mode):
      async                  dcp.async_save in a thread on the checkpoint's gloo group: the loop
                             blocks only while the state is copied to CPU memory.
      async_with_pinned_mem  the copy itself runs in the background (torch's DefaultStager,
                             buffers allocated once and reused; pinned on CUDA) and the upload
                             in a separate process; the next optimizer step waits for the copy.
                             On CPU there is no pinned memory (DefaultStager needs CUDA for it and
                             for non-blocking copies): the copy is a background memcpy into the
                             reused buffers, which still takes it off the training thread.
    In both, each rank checksums the files it wrote in a background thread too; the save is
    published at the first step at which every rank is done (`all_done`).
    """

    def __init__(
        self,
        cfg: JobConfig,
        model_parts: list[nn.Module],
        optimizer: torch.optim.Optimizer,
        lr_scheduler,
        dataloader: Stateful,
        train_state: Stateful,
        *,
        dp_rank: int = 0,
        dp_degree: int = 1,
        model_args: ModelArgs | None = None,
    ):
        """dp_rank / dp_degree: this rank's place in data parallelism (whose loader state it saves);
        model_args: checked against a checkpoint's shapes and written into its titan.json."""
        self.cfg = cfg
        c = self.cfg.checkpoint
        self.folder = Path(self.cfg.job.output_dir) / c.folder
        self.rank = dist.get_rank()
        self.interval = c.interval
        self.keep_latest_k = c.keep_latest_k
        self.async_mode = c.async_mode
        self.parts = ModelParts(model_parts, optimizer)
        self.lr_scheduler, self.dataloader, self.train_state = lr_scheduler, dataloader, train_state
        self.dp_rank, self.dp_degree, self.model_args = dp_rank, dp_degree, model_args
        self.pending: dict | None = None  # the async save in flight
        self.loaded_from: Path | None = None
        self.last_bytes = 0  # size on disk of the last complete save (the space a save needs)
        self.stats: list[dict] = []  # per save: step, mode, blocking_s, total_s
        # Its own gloo group with an I/O-sized timeout: the checkpoint's collectives never queue
        # behind (or interleave with) the training collectives, and it works beside NCCL.
        self.pg = checkpoint_group(self.cfg.comm.checkpoint_timeout_seconds)
        self.stager = self.poll_pg = self.background = None
        if self.async_mode != "disabled":
            # Whether a background save finished on every rank is agreed on this group each step
            # (self.pg may be busy with the background save's own collectives then); its
            # checksums run in this thread, off the training loop.
            self.poll_pg = checkpoint_group(self.cfg.comm.init_timeout_seconds)  # keeps it after step 1
            self.background = ThreadPoolExecutor(1, thread_name_prefix="checkpoint-checksums")
        if self.async_mode == "async_with_pinned_mem":
            cuda = torch.cuda.is_available()
            self.stager = DefaultStager(
                StagingOptions(
                    use_pinned_memory=cuda, use_shared_memory=True, use_async_staging=True, use_non_blocking_copy=cuda
                )
            )
            # The background copy must finish before parameters change.
            self._hook = optimizer.register_step_pre_hook(lambda *_: self.maybe_wait_for_staging())

    # ---------------------------------------------------------------------------------- load
    def load(self) -> bool:
        """Restore the latest complete checkpoint (or checkpoint.load_step / resume_from).
        Returns whether anything was loaded (the step is then in the train state). Nothing on
        disk is modified except stale `step-N.tmp` folders of a run killed mid-save, and the
        checkpoints later than checkpoint.load_step, moved aside (renamed, never deleted)."""
        c = self.cfg.checkpoint
        box: list = [None, None, None, 0]  # path, error, verification plan, bytes on disk
        if self.rank == 0:
            for stale in stale_tmp_dirs(self.folder):
                log.info(f"[checkpoint] removed {stale}: a save that never completed (a run stopped mid-save)")
                shutil.rmtree(stale, ignore_errors=True)
            try:
                path = resolve(self.folder, c.load_step, c.resume_from)
                if path is not None and c.load_step >= 0:  # into the past: later saves must not replace
                    moved = move_later_aside(self.folder, c.load_step)
                    if moved:
                        log.warning(
                            f"[checkpoint] resuming from step {c.load_step}: the later checkpoints were moved "
                            f"aside, kept and never loaded: {', '.join(str(m) for m in moved)}"
                        )
                if path is not None:
                    box = [path, None, verification_plan(path, dist.get_world_size(self.pg)), folder_bytes(path)]
            except CheckpointError as e:
                box[1] = str(e)
        # rank 0 decides for everyone (they must all load the same step)
        dist.broadcast_object_list(box, src=0, group=self.pg)
        path, error, plan, self.last_bytes = box
        if error:
            raise CheckpointError(error)
        if path is None:
            if c.create_seed_checkpoint:
                self.save(0, seed=True)
            return False
        t0 = time.perf_counter()
        if plan is not None:  # checksums first, each rank its share: a damaged file is named, never loaded
            verify_everywhere(Path(path), plan, self.pg)
        verified_s = time.perf_counter() - t0
        step = self._load(Path(path))
        self.loaded_from = Path(path)
        if self.rank == 0:
            log.info(
                f"[checkpoint] loaded {path} (step {step}) in {time.perf_counter() - t0:.2f} s "
                f"(checksums verified, split over {dist.get_world_size(self.pg)} rank(s), in {verified_s:.2f} s)"
            )
            change = self._layout_change(read_info(Path(path)))
            if change:
                log.warning(f"[checkpoint] resharded on load: {change}")
        return True

    def _load(self, path: Path) -> int:
        metadata = read_metadata(path)
        check_files(path, metadata)
        info = read_info(path)
        stored = metadata.state_dict_metadata
        items = self._load_items(path, stored, info)
        templates = {k: v.state_dict() for k, v in items.items()}
        check_shapes(path, metadata, templates, info, self.model_args)
        self._check_no_foreign_weights(path, stored, templates["model"], self.pg)
        with dcp_errors(lambda e: _raise(load_error(path, e))):
            trusted_load(items, path, process_group=self.pg)  # never runs what it reads
        return self.train_state.step if "train_state" in items else int(info.get("step", 0))

    def _load_items(self, path: Path, stored: dict, info: dict) -> dict[str, Stateful]:
        """What this load restores: the weights; with a full checkpoint the optimizer, scheduler,
        loader (this rank's copy, or rank 0's for another DP degree) and, on the same layout, the
        RNG. A weights-only checkpoint sets the step only when it is this run's own final export."""
        full = any(k.startswith("optimizer.") for k in stored)
        items: dict[str, Stateful] = {"model": ModelState(self.parts)}
        if "train_state.step" in stored and (full or path.parent == self.folder):
            self.train_state.with_history = "train_state.history" in stored  # older checkpoints have none
            items["train_state"] = self.train_state
        if not full:
            return items
        items |= {"optimizer": OptimizerState(self.parts), "lr_scheduler": JsonState(self.lr_scheduler)}
        dp_key = self._dataloader_key(stored, info)
        if dp_key:
            items["dataloader"] = JsonState(self.dataloader, dp_key)
        elif self.rank == 0:
            log.warning(f"[checkpoint] warning: {path} has no data-loader state; the data restarts from the beginning")
        rng = RngState(self.rank)
        if info.get("layout") == self._layout() and f"rng.{rng.key}" in stored:
            items["rng"] = rng
        return items

    @staticmethod
    def _check_no_foreign_weights(path: Path, stored: dict, model: dict, group) -> None:
        """Weights nobody here loads mean another model (a deeper one shares our first layers);
        a pipeline stage loads a subset, so compare with the union over all ranks."""
        names = [None] * dist.get_world_size(group)
        dist.all_gather_object(names, sorted(model), group=group)
        extra = sorted(
            {k.removeprefix("model.") for k in stored if k.startswith("model.")} - set().union(*map(set, names))
        )
        if extra:
            raise CheckpointError(
                f"{path / METADATA}: holds {len(extra)} model entries this model lacks "
                f"({', '.join(extra[:3])}{', ...' if len(extra) > 3 else ''}): "
                "a checkpoint of another model shape"
            )

    def _dataloader_key(self, stored: dict, info: dict) -> str | None:
        mine = dataloader_key(self.dp_rank)
        if info.get("dp_degree") == self.dp_degree and f"dataloader.{mine}" in stored:
            return mine
        # another DP degree: the loader's state is its place in the global stream, the same
        # on every rank, so rank 0's copy serves any degree
        return "dp_rank_0" if "dataloader.dp_rank_0" in stored else None

    def _global_batch(self) -> int:
        t, p = self.cfg.training, self.cfg.parallelism
        return t.local_batch_size * t.grad_accum_steps * p.dp_replicate * p.dp_shard

    def _layout_change(self, info: dict) -> str | None:
        """What differs from the layout that saved the checkpoint (degrees, global batch), if anything."""
        theirs, ours = info.get("layout") or {}, self._layout()
        changed = [f"{k} {theirs[k]} -> {v}" for k, v in ours.items() if k in theirs and theirs[k] != v]
        batch = info.get("global_batch")
        if batch is not None and batch != self._global_batch():
            changed.append(f"global batch {batch} -> {self._global_batch()} sequences per step")
        return "; ".join(changed) or None

    def _layout(self) -> dict:
        p = self.cfg.parallelism
        return {
            "pp": p.pp,
            "dp_replicate": p.dp_replicate,
            "dp_shard": p.dp_shard,
            "cp": p.cp,
            "tp": p.tp,
            "world_size": dist.get_world_size(),
        }

    # ---------------------------------------------------------------------------------- save
    def maybe_save(self, step: int) -> None:
        self._poll()
        last = step == self.cfg.training.steps
        if step % self.interval == 0 or last:
            self.save(step, last=last)

    def _save_items(self, model_only: bool, dtype: torch.dtype | None) -> dict[str, Stateful]:
        items: dict[str, Stateful] = {"model": ModelState(self.parts, dtype), "train_state": self.train_state}
        if model_only:
            return items
        return items | {
            "optimizer": OptimizerState(self.parts),
            "lr_scheduler": JsonState(self.lr_scheduler),
            "dataloader": JsonState(self.dataloader, dataloader_key(self.dp_rank)),
            "rng": RngState(self.rank),
        }

    def _info(self, step: int, kind: str, dtype: str) -> dict:
        args = self.model_args
        return {
            "step": step,
            "kind": kind,  # full | model (weights only) | seed
            "dtype": dtype,
            "model_args": dataclasses.asdict(args) if args is not None else None,
            "model_shape": model_shape(args) if args is not None else None,
            "flavor": self.cfg.model.flavor,
            "layout": self._layout(),
            "global_batch": self._global_batch(),
            "dp_degree": self.dp_degree,
            "torch": torch.__version__,
            "manifest": MANIFEST,  # written with one: a missing one is damage
            "config": self.cfg.to_dict(),  # what ran: a resume says what it changes (core/run_folder.py)
        }

    @torch.no_grad()
    def save(self, step: int, last: bool = False, seed: bool = False) -> None:
        # one save in flight at a time (the wait counts for that save, except the end-of-run one)
        self._wait_pending(in_loop=not last)
        t0 = time.perf_counter()
        c = self.cfg.checkpoint
        model_only = seed or (last and c.model_weights_only)
        dtype = DTYPES[c.export_dtype] if model_only and not seed else None
        state = self._save_items(model_only, dtype)
        kind = "seed" if seed else "model" if model_only else "full"
        info = self._info(step, kind, c.export_dtype if dtype else "float32")
        tmp = tmp_dir(self.folder, step)
        if self.rank == 0:
            self.folder.mkdir(parents=True, exist_ok=True)
        progress = SaveProgress(step, self.rank)
        # The last save has nothing left to overlap with: synchronous.
        if self.async_mode == "disabled" or last or seed:
            with dcp_errors(lambda e: self._failed(step, tmp, "save", e)), progress.phase("DCP write"):
                dcp.save(state, checkpoint_id=str(tmp), process_group=self.pg)
            self._finalize(step, tmp, info, progress)
            dt = time.perf_counter() - t0
            self.stats.append({"step": step, "mode": "sync", "blocking_s": dt, "wait_s": 0.0, "total_s": dt})
            return
        with dcp_errors(lambda e: self._failed(step, tmp, "async save", e)):
            if self.async_mode == "async":
                upload = dcp.async_save(state, checkpoint_id=str(tmp), process_group=self.pg)
                staging = None
            else:
                resp = dcp.async_save(
                    state,
                    checkpoint_id=str(tmp),
                    process_group=self.pg,
                    async_checkpointer_type=AsyncCheckpointerType.PROCESS,
                    async_stager=self.stager,
                )
                upload, staging = resp.upload_completion, resp.staging_completion
        p = self.pending = {
            "step": step,
            "tmp": tmp,
            "info": info,
            "upload": upload,
            "staging": staging,
            "t0": t0,
            "blocking_s": time.perf_counter() - t0,
            "progress": progress,
        }
        upload.add_done_callback(lambda _: p.setdefault("done_at", time.perf_counter()))
        p["checksums"] = self.background.submit(self._upload_then_checksums, upload, tmp)

    def _upload_then_checksums(self, upload, tmp: Path) -> dict:
        """In the background: wait for this rank's write, then checksum the files it wrote."""
        upload.result()
        return own_checksums(tmp, self.rank)

    def maybe_wait_for_staging(self) -> None:
        p = self.pending
        if p is not None and p["staging"] is not None:
            t0 = time.perf_counter()
            p["staging"].result()
            p["staging"] = None
            p["blocking_s"] += time.perf_counter() - t0

    def _poll(self) -> None:
        """Publish the background save once it finished on every rank (the same step everywhere)."""
        if self.pending is not None and all_done(self.pending["checksums"].done(), self.poll_pg):
            self._wait_pending()

    def _wait_pending(self, in_loop: bool = True) -> None:
        p, self.pending = self.pending, None
        if p is None:
            return
        t0 = time.perf_counter()
        with dcp_errors(lambda e: self._failed(p["step"], p["tmp"], "async save", e)):
            if p["staging"] is not None:
                p["staging"].result()
            mine = p["checksums"].result()  # the upload, then this rank's checksums
        if in_loop:  # the end-of-run flush is not loop time
            p["wait_s"] = time.perf_counter() - t0  # the next save waited for this upload
            p["blocking_s"] += p["wait_s"]
        progress = p["progress"]
        progress.add("DCP write (background)", p.get("done_at", time.perf_counter()) - p["t0"])
        progress.add("checksums", mine.get("seconds", 0.0))
        self._finalize(p["step"], p["tmp"], p["info"], progress, mine)
        self.stats.append(
            {
                "step": p["step"],
                "mode": self.async_mode,
                "blocking_s": p["blocking_s"],
                "wait_s": p.get("wait_s", 0.0),
                "total_s": p.get("done_at", time.perf_counter()) - p["t0"],
            }
        )

    def _finalize(self, step: int, tmp: Path, info: dict, progress: SaveProgress, mine: dict | None = None) -> None:
        """After DCP finished on every rank: each rank checksums the files it wrote (`mine`, when
        an async save did it in the background) and every rank gets all the parts; rank 0 writes
        titan.json, then the manifest (last), then marks the checkpoint complete by a rename."""
        if mine is None:
            with progress.phase("checksums"):
                mine = own_checksums(tmp, self.rank)
        with progress.phase("waiting for the other ranks' checksums"):
            parts = gather_checksums(mine, self.pg)
        errors = [p["error"] for p in parts if "error" in p]
        if errors:  # every rank raises; rank 0 removes the folder
            self._failed(step, tmp, "checksums", errors[0])
        self.last_bytes = sum(p["bytes"] for p in parts)
        progress.notes["checksums"] = slowest(parts)
        failed: list[BaseException | None] = [None]
        if self.rank == 0:
            try:
                with progress.phase("manifest and rename"):
                    atomic_write_json(tmp / INFO, info, indent=1)
                    self.last_bytes = write_manifest(tmp, parts)
                    publish(tmp, self.folder, step)
                purge(self.folder, self.keep_latest_k)
            except OSError as e:
                failed = [e]
        # every rank learns whether rank 0 could finish: all raise alike, none walks on alone
        dist.broadcast_object_list(failed, src=0, group=self.pg)
        if failed[0] is not None:
            self._failed(step, tmp, "finalize", failed[0])
        progress.done()

    def _failed(self, step: int, tmp: Path, what: str, e: BaseException) -> None:
        """A failed save: remove its partial folder (rank 0), keep the latest complete checkpoint,
        and raise one CheckpointError naming the folder, the cause and, for a full disk, the space."""
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        # the whole checkpoint: the weights (a DTensor counts its global size) and two Adam moments
        need = self.last_bytes or 3 * self.parts.state_bytes()
        raise save_error(self.folder, tmp, step, what, e, need) from None

    def close(self) -> None:
        """Wait for the save in flight and release the background resources."""
        try:
            self._wait_pending(in_loop=False)
        finally:
            if self.background is not None:
                self.background.shutdown()
                self.background = None
            if self.stager is not None:
                self._hook.remove()
                self.stager.close()
                self.stager = None
