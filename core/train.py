"""The one training loop, the same for every layout.

Launch: `torchrun --nproc_per_node N -m core.train --config job.toml [--section.key=value ...]`
(or `python -m core.train ...` for one process). Rank 0 writes `result.json` (the result record,
core/result.py) and `metrics.jsonl` in `job.output_dir`. Repeating `--config` runs several jobs
of one world size one after another in one process group (start-up and imports paid once); rank 0
prints `JOB_MARKER <output_dir>` before each, so a reader can split the output per job.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from core import cpu_gemm, run_folder
from core.build import build_model, with_attention_dtype
from core.checkpoint.checkpointer import Checkpointer
from core.checkpoint.folder import CheckpointError
from core.checkpoint.state import TrainState
from core.config import JOB_MARKER, ConfigError, JobConfig
from core.data.datasets import build_dataloader
from core.data.shards import CorpusError
from core.data.tokenizer import Tokenizer
from core.debug import (
    dump_flight_recorder,
    dump_on_sigterm,
    first_step_timeout,
    maybe_pause,
    report_failure,
    set_pg_timeouts,
    setup_flight_recorder,
)
from core.group_timeouts import own_timeout_groups
from core.jobs import parse_jobs, rank_prefix, validated_jobs
from core.lazy_imports import prepare_for_fork
from core.logs import get_logger
from core.metrics import (
    PeakFlops,
    PeakMemory,
    StepLog,
    cpu_peak,
    device_info,
    flops_per_token,
    peak_memory_gib,
    trim_metrics,
)
from core.models.args import model_args
from core.noise import quiet_library_warnings
from core.optim import build_lr_scheduler, build_optimizer, clip_grad_norm_, follow_settings
from core.parallel.mesh import ParallelDims, device_type
from core.parallel.parallelize import Toggles
from core.process import die_with_parent, exit_process, process_age_s, raise_open_file_limit, record_rank_pid
from core.result import TrainOutcome, local_state_bytes, pp_record, result_record, write_result
from core.run_folder import RUN_LOCK_ENV, RunDirBusy
from core.step import TrainStep, pipeline_loss
from core.step_hooks import GCAtSteps, StepProfiler
from core.toggles import compile_cache
from core.toggles.float8 import post_optimizer_hook

log = get_logger(__name__)

if __name__ == "__mp_main__":
    # DCP's checkpoint process (async_with_pinned_mem) re-imports this module as its main and logs
    # from there, before any trainer exists.
    quiet_library_warnings()


def init_distributed(cfg: JobConfig) -> None:
    if dist.is_initialized():
        return
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    timeout = datetime.timedelta(seconds=first_step_timeout(cfg).seconds)  # until the first step is done
    setup_flight_recorder(cfg)  # its environment must exist before the process group
    dump_on_sigterm(cfg)
    if "RANK" in os.environ:  # torchrun
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group(backend, timeout=timeout)
    else:  # a single process without a launcher
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)


class NonFiniteError(FloatingPointError):
    """A non-finite loss or grad norm stopped the run (the update was never applied or saved)."""


@dataclass
class StepResult:
    """One optimizer step: the global batch's loss and grad norm, and whether the update was
    applied (the non-finite guard skips it on every rank together)."""

    loss: float
    grad_norm: float
    applied: bool


@dataclass
class LoopLog:
    """What this rank's loop measured, step by step."""

    start_step: int  # > 0 when resumed from a checkpoint
    losses: list[float] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)
    step_times_s: list[float] = field(default_factory=list)
    data_times_s: list[float] = field(default_factory=list)
    skipped_nonfinite_steps: list[int] = field(default_factory=list)
    wall_s: float = 0.0
    first_step_peak_gib: float | None = None
    profile: dict | None = None


class Trainer:
    def __init__(self, cfg: JobConfig):
        quiet_library_warnings()
        self.cfg = cfg
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.device = (
            torch.device(device_type(), torch.cuda.current_device())
            if torch.cuda.is_available()
            else torch.device("cpu")
        )
        cpu_gemm.use(cpu_gemm.resolve(cfg.training.bf16_gemm, self.device, cfg.training.mixed_precision_param))
        self.out_dir = Path(cfg.job.output_dir)
        self.dims = ParallelDims.from_config(cfg.parallelism)
        self.mesh = self.dims.build_mesh(self.device.type, first_step_timeout(cfg).seconds)
        self.toggles = Toggles()
        torch.manual_seed(cfg.job.seed)
        if cfg.job.deterministic:
            torch.use_deterministic_algorithms(True)

        self.tokenizer = None
        if cfg.data.dataset != "synthetic":
            self.tokenizer = Tokenizer(cfg.tokenizer.path, cfg.tokenizer.sha256 or None)
        self.model_args = with_attention_dtype(
            model_args(cfg, self.tokenizer.n_words if self.tokenizer else None), cfg, self.device
        )
        self.model = build_model(
            self.model_args, cfg, self.mesh, self.dims, self.device, self.toggles, pipeline_loss(cfg)
        )
        self.model_parts, self.pp_schedule = self.model.parts, self.model.schedule
        self.step_fn = TrainStep(cfg, self.mesh, self.device, self.model)
        self.optimizer = build_optimizer(self.model_parts, cfg)
        self.post_optimizer_hook = post_optimizer_hook(cfg)  # Float8: precompute FSDP scales
        self.lr_scheduler = build_lr_scheduler(self.optimizer, cfg)
        dp_mesh = self.mesh["dp"]
        self.dataloader = build_dataloader(
            cfg,
            self.tokenizer,
            dp_rank=dp_mesh.get_local_rank(),
            dp_degree=dp_mesh.size(),
            vocab_size=self.model_args.vocab_size,
        )
        self.train_state = TrainState()
        self.checkpointer = None
        if cfg.checkpoint.enabled:
            self.checkpointer = Checkpointer(
                cfg,
                self.model_parts,
                self.optimizer,
                self.lr_scheduler,
                self.dataloader,
                self.train_state,
                dp_rank=dp_mesh.get_local_rank(),
                dp_degree=dp_mesh.size(),
                model_args=self.model_args,
            )

    @property
    def step(self) -> int:
        return self.train_state.step

    def train_step(self, batches) -> StepResult:
        self.optimizer.zero_grad()
        loss = torch.zeros((), device=self.device)
        for inputs, labels in batches:
            micro_loss = self.step_fn.forward_backward(inputs, labels)
            if hasattr(micro_loss, "full_tensor"):  # loss parallel: a replicated DTensor
                micro_loss = micro_loss.full_tensor()
            loss += micro_loss
        if self.pp_schedule is not None:
            # exactly one pp rank holds the last stage: summing over pp broadcasts its loss
            dist.all_reduce(loss, group=self.mesh["pp"].get_group())
        params = [p for m in self.model_parts for p in m.parameters()]
        pp_group = self.mesh["pp"].get_group() if self.dims.pp > 1 else None
        grad_norm = clip_grad_norm_(params, self.cfg.training.max_norm, pp_group)
        # the loss of the global batch: every dp x cp rank saw an equal share of its tokens
        dp_cp = self.mesh["dp_cp"]
        if dp_cp.size() > 1:
            dist.all_reduce(loss, group=dp_cp.get_group())
            loss = loss / dp_cp.size()
        loss_f, gnorm_f = loss.item(), float(grad_norm)
        # Non-finite guard: the global norm and loss are the same on every rank, so every rank
        # skips together; a skipped step leaves weights, optimizer and LR untouched.
        if not (math.isfinite(loss_f) and math.isfinite(gnorm_f)):
            self.optimizer.zero_grad()
            return StepResult(loss_f, gnorm_f, applied=False)
        self.optimizer.step()
        if self.post_optimizer_hook is not None:
            self.post_optimizer_hook(self.model_parts)
        self.lr_scheduler.step()
        return StepResult(loss_f, gnorm_f, applied=True)

    def _nonfinite_step(self, result: StepResult, skipped: list[int]) -> None:
        """A step whose loss or grad norm was not finite (its update was skipped): stop, or go on
        while at most training.skip_nonfinite_steps such steps were seen."""
        skipped.append(self.step)
        loss, gnorm = result.loss, result.grad_norm
        what = f"loss is {loss}" if not math.isfinite(loss) else f"grad norm is {gnorm} (loss {loss:.4f})"
        limit = self.cfg.training.skip_nonfinite_steps
        if len(skipped) <= limit:
            if self.rank == 0:
                log.info(
                    f"[train] step {self.step}: {what}; update skipped ({len(skipped)} of "
                    f"training.skip_nonfinite_steps={limit})"
                )
            return
        if self.checkpointer:  # finish the save of the last good step; this state is never saved
            self.checkpointer.close()
        raise NonFiniteError(
            f"step {self.step}: {what}; update skipped and the run stopped "
            f"(training.skip_nonfinite_steps={limit}); the last complete checkpoint "
            "is kept and holds finite weights"
        )

    # ---------------------------------------------------------------------------------- loop
    def train(self) -> dict:
        """Resume, run the loop to training.steps and return the record (a collective). A seed
        checkpoint run saves the initial weights as step 0 and stops there."""
        start = self._resume()
        seed = self.cfg.checkpoint.create_seed_checkpoint
        if seed and self.checkpointer and self.checkpointer.loaded_from is not None:
            raise CheckpointError(
                f"checkpoint.create_seed_checkpoint: {self.checkpointer.folder} already holds a checkpoint "
                f"({self.checkpointer.loaded_from.name}): a seed is a new run's initial weights; use another --out"
            )
        run_log = LoopLog(start) if seed else self._loop(start)
        if self.checkpointer:
            self.checkpointer.close()
        return result_record(self._outcome(run_log))

    def _resume(self) -> int:
        """Load the latest checkpoint (if any); the step the loop starts after. A resumed run
        follows this run's optimizer settings and LR schedule from its next step on."""
        if self.checkpointer and self.checkpointer.load():
            lr = follow_settings(self.optimizer, self.lr_scheduler, self.cfg)
            if self.rank == 0:
                log.info(f"[checkpoint] step {self.step + 1} on: this run's optimizer and LR schedule (lr {lr:.3g})")
        start = self.step
        if start >= self.cfg.training.steps and self.checkpointer:  # (a fresh run starts at 0)
            raise CheckpointError(
                f"training.steps: {self.cfg.training.steps} is not above the step {start} of the "
                f"checkpoint loaded from {self.checkpointer.loaded_from}: nothing to train "
                f"(set training.steps > {start})"
            )
        if self.rank == 0:  # a resumed (or re-used) folder: metrics.jsonl continues without duplicates
            trim_metrics(self.out_dir / "metrics.jsonl", start)
        return start

    def _loop(self, start_step: int) -> LoopLog:
        cfg, t = self.cfg, self.cfg.training
        run_log = LoopLog(start_step)
        data_iter = iter(self.dataloader)
        metrics = StepLog(
            self.out_dir,
            self.rank,
            cfg,
            tokens_per_device=self.tokens_per_step / self.world_size,
            flops_per_token=flops_per_token(self.model_args, t.seq_len),
            peak_flops=self.peak_flops,
            first_step=start_step,
            peak_is_cpu=self.peak.gemm_route is not None and not cfg.metrics.peak_flops,
        )
        wall0 = time.perf_counter()
        gc_at_steps = GCAtSteps(t.gc_freq)
        profiler = StepProfiler(
            cfg.profiling, self.out_dir, self.rank, self.device.type, cfg.comm.checkpoint_timeout_seconds
        )
        try:
            while self.step < t.steps:
                self.train_state.step += 1
                profiler.before_step(self.step)
                # the step time is the whole iteration, data included (throughput counts it); the
                # data part is also recorded on its own
                t0 = time.perf_counter()
                batches = [next(data_iter) for _ in range(t.grad_accum_steps)]
                data_dt = time.perf_counter() - t0
                lr = self.optimizer.param_groups[0]["lr"]  # the lr this step applies (the scheduler steps after)
                result = self.train_step(batches)
                if self.device.type == "cuda":
                    torch.cuda.synchronize()
                dt = time.perf_counter() - t0
                if profiler.after_step(self.step) and self.rank == 0:
                    metrics.write(profiler.headline())
                if not result.applied:
                    self._nonfinite_step(result, run_log.skipped_nonfinite_steps)
                run_log.losses.append(result.loss)
                run_log.grad_norms.append(result.grad_norm)
                self.train_state.record(result.loss, result.grad_norm)  # saved with the checkpoint
                run_log.step_times_s.append(dt)
                run_log.data_times_s.append(data_dt)
                metrics.log(self.step, result.loss, result.grad_norm, lr, dt, data_dt)
                if self.checkpointer:
                    self.checkpointer.maybe_save(self.step)
                if self.step == start_step + 1:
                    run_log.first_step_peak_gib = self._first_step_done()
                maybe_pause(self.step, self.out_dir, self.rank)  # fault-injection hook (tests)
                gc_at_steps.step(self.step)
        finally:
            gc_at_steps.close()
            profiler.close()
            metrics.close()
        run_log.wall_s = time.perf_counter() - wall0
        run_log.profile = profiler.summary
        return run_log

    def _first_step_done(self) -> float:
        """After the first step (lazy init, compilation, PP shape inference): keep its memory peak
        apart from the steady one, and apply the shorter training timeout from now on."""
        first_peak = PeakMemory().first_step_done()
        dist.barrier()
        set_pg_timeouts(self.cfg.comm.train_timeout_seconds, exclude=own_timeout_groups())  # core/group_timeouts.py
        return first_peak

    def _outcome(self, run_log: LoopLog) -> TrainOutcome:
        """The record's values; every rank gathers the per-rank memory and state bytes."""
        cfg, t, n = self.cfg, self.cfg.training, self.world_size
        gathered: dict[str, list] = {}
        bytes_here = local_state_bytes(self.model_parts, self.optimizer)
        for key, mine in (
            ("peak", peak_memory_gib()),
            ("first", run_log.first_step_peak_gib),
            ("params", bytes_here["params"]),
            ("optim", bytes_here["optimizer"]),
        ):
            gathered[key] = [None] * n
            dist.all_gather_object(gathered[key], mine)
        p = cfg.parallelism
        pipeline = pp_record(p.pp_schedule, self.dims.pp, self.model.microbatches, len(self.model.stages))
        return TrainOutcome(
            cfg=cfg,
            model_args=self.model_args,
            world_size=n,
            device_type=self.device.type,
            params=sum(q.numel() for m in self.model_parts for q in m.parameters()) if self.dims.pp == 1 else None,
            toggles_applied=self.toggles.applied,
            toggles_skipped=self.toggles.skipped,
            pipeline=pipeline if self.pp_schedule is not None else {},
            start_step=run_log.start_step,
            losses=run_log.losses,
            grad_norms=run_log.grad_norms,
            step_times_s=run_log.step_times_s,
            data_times_s=run_log.data_times_s,
            skipped_nonfinite_steps=run_log.skipped_nonfinite_steps,
            history={"from_step": self.train_state.history_from, **self.train_state.history},
            skipped_bad_documents=self.dataloader.bad_documents,
            wall_s=run_log.wall_s,
            tokens_per_step=self.tokens_per_step,
            flops_per_token=flops_per_token(self.model_args, t.seq_len),
            peak=self.peak,
            peak_memory_gib_per_rank=gathered["peak"],
            first_step_peak_memory_gib_per_rank=gathered["first"],
            param_bytes_per_rank=gathered["params"],
            optimizer_bytes_per_rank=gathered["optim"],
            profile=run_log.profile,
        )

    @property
    def tokens_per_step(self) -> int:
        t = self.cfg.training
        return t.local_batch_size * t.seq_len * t.grad_accum_steps * self.dims.dp

    @functools.cached_property
    def peak(self) -> PeakFlops:
        """The MFU denominator: metrics.peak_flops, the GPU's vendor figure, or on a CPU the peak
        measured on the GEMM route the steps run (core.cpu_gemm). A GPU the vendor table does not
        know gets None (no MFU), never a CPU's figure."""
        t = self.cfg.training
        if self.cfg.metrics.peak_flops:
            return PeakFlops(self.cfg.metrics.peak_flops, "metrics.peak_flops (given)", None)
        if self.device.type == "cuda":
            info = device_info()
            return PeakFlops(info["peak_flops"], info["peak_source"], None)
        return cpu_peak(t.mixed_precision_param if t.mixed_precision_param == "bfloat16" else "float32")

    @property
    def peak_flops(self) -> float | None:
        return self.peak.flops


def before_fork(argv: list[str]) -> None:
    """Called by recipes/forked_run.py before it forks the ranks: import what the jobs import lazily
    and warm what their first compile computes alike (core.lazy_imports.prepare_for_fork)."""
    with contextlib.suppress(ConfigError):  # each rank's main() reports it
        prepare_for_fork(parse_jobs(argv))


def run(cfg: JobConfig, startup_s: dict[str, float | None] | None = None) -> dict:
    """Train with an already validated config inside an initialised process group. `startup_s`:
    where this process's time went before the trainer (the first job of a launch has it)."""
    t0 = time.perf_counter()
    # A job starts with Dynamo as a new process has it. A job before it in this process (run_jobs,
    # recipes.studies.group_worker) left its compiled frames: the same block code on other shapes
    # then recompiled with a dynamic batch (automatic dynamic), a program a run of its own never builds.
    torch.compiler.reset()
    cache_before = compile_cache.all_counts()
    trainer = Trainer(cfg)
    t_init = time.perf_counter() - t0
    record = trainer.train()
    record["first_step_timeout_s"], record["first_step_timeout_reason"] = first_step_timeout(cfg)
    if cfg.compile.enabled:  # a cold first step compiles: say whether the graphs came from the cache
        record["compile_shared_cache"] = compile_cache.active()  # compile.shared_cache, as resolved
        for cache, lookups in compile_cache.counts_of_all_ranks(cache_before).items():
            record[f"{cache}_cache_all_ranks"] = lookups
    steps = record["step_times_s"]
    # rank 0's time per phase: the first step pays lazy init and compilation; "other" is the
    # logger, checkpoint load and the record's gathers
    record["timings_s"] = {
        **(startup_s or {}),
        "trainer_init": t_init,
        "first_step": steps[0] if steps else 0.0,
        "later_steps": sum(steps[1:]),
        "other": time.perf_counter() - t0 - t_init - sum(steps),
    }
    if trainer.rank == 0:
        write_result(cfg, record)
    return record


def run_jobs(cfgs: list[JobConfig], startup_s: dict[str, float | None]) -> None:
    """The jobs one after another in this process group; rank 0 marks where each one's output starts."""
    for i, cfg in enumerate(cfgs):
        if len(cfgs) > 1:
            dist.barrier()  # the previous job's output is out before the marker
            if dist.get_rank() == 0:
                print(f"{JOB_MARKER} {cfg.job.output_dir}", flush=True)  # a protocol line, not a log line
        run(cfg, startup_s if i == 0 else None)  # a later job's start-up was paid by the first


def main(argv: list[str] | None = None) -> int:
    die_with_parent()  # an agent (torchrun) that dies takes its ranks with it
    record_rank_pid()  # the agent names this rank if a signal kills it
    raise_open_file_limit()  # a soft ulimit -n inherited through SLURM: several gloo groups at 512 ranks
    startup_s = {"process_start_and_imports": process_age_s()}
    quiet_library_warnings()
    try:
        cfgs = validated_jobs(argv)
    except ConfigError as e:
        log.error(f"config error: {e}")
        return 2
    cfg = cfgs[0]
    if any(c.job.deterministic for c in cfgs):
        # cuBLAS's deterministic mode needs its workspace fixed before its first handle exists
        # (torch.use_deterministic_algorithms raises at the first matmul without it)
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    t0 = time.perf_counter()
    init_distributed(cfg)
    startup_s["init_distributed"] = time.perf_counter() - t0  # the rendezvous: waits for the slowest rank
    try:
        with contextlib.ExitStack() as owned:
            folders = [Path(c.job.output_dir) for c in cfgs]
            if os.environ.get(RUN_LOCK_ENV) == "1":  # a SLURM job owns its folders: rank 0 takes them
                run_folder.lock_for_job(folders, owned)
            for folder in folders:  # every rank writes there: the folder is not free while one lives
                run_folder.hold(folder)
            run_jobs(cfgs, startup_s)
    except RunDirBusy as e:  # another run holds a folder: nothing of this job ran
        if dist.get_rank() == 0:
            log.error(f"error: {e}")
        return 2
    except (CheckpointError, NonFiniteError, CorpusError) as e:
        # the project's own failures, in one line. Raised alike on every rank, rank 0 says it and
        # torchrun stops the others while they wait; raised on one rank only, that rank says it.
        dump_flight_recorder(cfg, reason=f"{type(e).__name__}: {e}")
        if dist.get_rank():
            time.sleep(2)
        log.error(f"{rank_prefix()}error: {e}")
        return 1
    except Exception as e:
        if report_failure(cfg, e):  # its Flight Recorder dump; a hang or a damaged compile cache in one line
            return 1
        if dist.get_rank():  # the traceback's last line does not say which rank raised
            log.error(f"{rank_prefix()}{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
        raise
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    exit_process(main())
