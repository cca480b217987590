"""The one training loop, the same for every layout.

Launch: `torchrun --nproc_per_node N -m core.train --config job.toml [--section.key=value ...]`
(or `python -m core.train ...` for one process). Rank 0 writes `result.json` (the result record,
core/result.py) and `metrics.jsonl` in `job.output_dir`. Repeating `--config` runs several jobs
of one world size one after another in one process group (start-up and imports paid once); rank 0
prints `JOB_MARKER <output_dir>` before each, so a reader can split the output per job.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import datetime
import math
import multiprocessing
import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from tqdm import tqdm

from core import cpu_gemm
from core.build import build_model, schedule_stages, with_attention_dtype
from core.checkpoint import Checkpointer
from core.checkpoint_folder import CheckpointError
from core.checkpoint_state import TrainState
from core.config import JOB_MARKER, ConfigError, JobConfig, load_config
from core.data.datasets import BadDocumentError, build_dataloader
from core.data.tokenizer import Tokenizer
from core.debug import dump_flight_recorder, dump_on_sigterm, maybe_pause, set_pg_timeouts, setup_flight_recorder
from core.hardware import check_hardware
from core.lazy_imports import import_for
from core.metrics import (
    MetricsLogger,
    PeakMemory,
    cpu_peak_flops,
    device_info,
    flops_per_token,
    peak_memory_gib,
    trim_metrics,
)
from core.models.args import model_args
from core.noise import quiet_library_warnings
from core.optim import build_lr_scheduler, build_optimizer, clip_grad_norm_
from core.parallel.context import loss_parallel_context, step_context
from core.parallel.mesh import ParallelDims, device_type
from core.parallel.parallelize import Toggles
from core.result import result_record, write_result
from core.step_hooks import GCAtSteps, StepProfiler
from core.toggles import compile_cache
from core.toggles.float8 import post_optimizer_hook
from core.validate import validate

if __name__ == "__mp_main__":
    # DCP's checkpoint process (async_with_pinned_mem) re-imports this module as its main and logs
    # from there, before any trainer exists.
    quiet_library_warnings()


def cross_entropy_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1))


def pipeline_loss(cfg: JobConfig) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The pipeline schedule's loss of one microbatch: scaled like the non-pipelined step's."""
    accum = cfg.training.grad_accum_steps
    return lambda logits, labels: cross_entropy_loss(logits, labels) / accum


def init_distributed(cfg: JobConfig) -> None:
    if dist.is_initialized():
        return
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    timeout = datetime.timedelta(seconds=cfg.comm.init_timeout_seconds)
    setup_flight_recorder(cfg)  # its environment must exist before the process group
    dump_on_sigterm(cfg)
    if "RANK" in os.environ:  # torchrun
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group(backend, timeout=timeout)
    else:  # a single process without a launcher
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)


class TrainStep:
    """One rank's forward + backward of one microbatch, for every layout (the trainer's step; the
    dry-run's fake step runs it too): the CP context around both, loss parallel around the loss,
    the pipeline schedule when there is one, bf16 autocast when nothing else casts."""

    def __init__(self, cfg: JobConfig, mesh, device: torch.device, model_parts: list[nn.Module], pp_schedule=None):
        self.cfg, self.mesh, self.device = cfg, mesh, device
        self.model_parts, self.pp_schedule = model_parts, pp_schedule
        self.stages = schedule_stages(pp_schedule) if pp_schedule is not None else []
        # Without FSDP nothing casts parameters for compute: bf16 runs under autocast.
        self.autocast_bf16 = (
            cfg.training.mixed_precision_param == "bfloat16"
            and not ParallelDims.from_config(cfg.parallelism).fsdp_enabled
        )

    def _autocast(self):
        return torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.autocast_bf16)

    def forward_backward(self, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        accum = self.cfg.training.grad_accum_steps
        inputs, labels = inputs.to(self.device), labels.to(self.device)
        with step_context(self.cfg, self.mesh, inputs, labels, self.model_parts):
            if self.pp_schedule is not None:
                losses: list[torch.Tensor] = []
                has_first = any(s.is_first for s in self.stages)
                has_last = any(s.is_last for s in self.stages)
                with loss_parallel_context(self.cfg):
                    self.pp_schedule.step(
                        *([inputs] if has_first else []), target=labels if has_last else None, losses=losses
                    )
                loss = torch.stack(losses).sum() if has_last else torch.zeros((), device=self.device)
                return loss.detach()  # per-microbatch losses were already divided by accum
            model = self.model_parts[0]
            with loss_parallel_context(self.cfg):
                with self._autocast():
                    logits = model(inputs)
                loss = cross_entropy_loss(logits, labels) / accum
                del logits
                loss.backward()
        return loss.detach()


class NonFiniteError(FloatingPointError):
    """A non-finite loss or grad norm stopped the run (the update was never applied or saved)."""


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
        self.mesh = self.dims.build_mesh(self.device.type, cfg.comm.init_timeout_seconds)
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

        self.model_parts, self.pp_schedule = build_model(
            self.model_args, cfg, self.mesh, self.dims, self.device, self.toggles, pipeline_loss(cfg)
        )
        self.step_fn = TrainStep(cfg, self.mesh, self.device, self.model_parts, self.pp_schedule)
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
        self.skipped_last_step, self.skipped_steps = False, []  # the non-finite guard's steps
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

    def train_step(self, batches) -> tuple[float, float]:
        self.optimizer.zero_grad()
        loss = torch.zeros((), device=self.device)
        for inputs, labels in batches:
            micro_loss = self.step_fn.forward_backward(inputs, labels)
            if hasattr(micro_loss, "full_tensor"):  # loss parallel: a replicated DTensor
                micro_loss = micro_loss.full_tensor()
            loss += micro_loss
        if self.pp_schedule is not None:
            n_micro = self.pp_schedule._n_microbatches
            loss = loss / n_micro
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
        self.skipped_last_step = not (math.isfinite(loss_f) and math.isfinite(gnorm_f))
        if self.skipped_last_step:
            self.optimizer.zero_grad()
            return loss_f, gnorm_f
        self.optimizer.step()
        if self.post_optimizer_hook is not None:
            self.post_optimizer_hook(self.model_parts)
        self.lr_scheduler.step()
        return loss_f, gnorm_f

    def _nonfinite_step(self, loss: float, gnorm: float) -> None:
        """A step whose loss or grad norm was not finite (its update was skipped): stop, or go on
        while at most training.skip_nonfinite_steps such steps were seen."""
        self.skipped_steps.append(self.step)
        what = f"loss is {loss}" if not math.isfinite(loss) else f"grad norm is {gnorm} (loss {loss:.4f})"
        limit = self.cfg.training.skip_nonfinite_steps
        if len(self.skipped_steps) <= limit:
            if self.rank == 0:
                print(
                    f"[train] step {self.step}: {what}; update skipped ({len(self.skipped_steps)} of "
                    f"training.skip_nonfinite_steps={limit})",
                    flush=True,
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
        cfg, t = self.cfg, self.cfg.training
        if self.checkpointer:
            self.checkpointer.load()
        self.start_step = self.step  # > 0 when resumed from a checkpoint
        if self.start_step >= t.steps and not getattr(self.checkpointer, "loaded_final_export", False):
            raise CheckpointError(
                f"training.steps: {t.steps} is not above the step {self.start_step} of the "
                f"checkpoint loaded from {self.checkpointer.loaded_from}: nothing to train "
                f"(set training.steps > {self.start_step})"
            )
        if self.rank == 0:  # a resumed (or re-used) folder: metrics.jsonl continues without duplicates
            trim_metrics(self.out_dir / "metrics.jsonl", self.start_step)
        logger = MetricsLogger(self.out_dir, self.rank, cfg.metrics.enable_tensorboard)
        data_iter = iter(self.dataloader)
        tokens_per_step = t.local_batch_size * t.seq_len * t.grad_accum_steps * self.dims.dp
        fpt = flops_per_token(self.model_args, t.seq_len)
        peak = (
            cfg.metrics.peak_flops
            or device_info()["peak_flops"]
            or cpu_peak_flops(t.mixed_precision_param if t.mixed_precision_param == "bfloat16" else "float32")
        )
        losses, grad_norms, step_times, self.data_times = [], [], [], []
        self.memory = PeakMemory()
        progress = None
        if self.rank == 0 and cfg.metrics.progress:
            progress = tqdm(
                total=t.steps, initial=self.step, desc=cfg.job.name, unit="step", file=sys.stderr, dynamic_ncols=True
            )
        wall0 = time.perf_counter()
        gc_at_steps = GCAtSteps(t.gc_freq)
        profiler = StepProfiler(cfg.profiling, self.out_dir, self.rank, self.device.type)
        try:
            while self.step < t.steps:
                self.train_state.step += 1
                profiler.before_step(self.step)
                # the step time is the whole iteration, data included (throughput counts it); the
                # data part is also recorded on its own
                t0 = time.perf_counter()
                batches = [next(data_iter) for _ in range(t.grad_accum_steps)]
                data_dt = time.perf_counter() - t0
                loss, gnorm = self.train_step(batches)
                if self.device.type == "cuda":
                    torch.cuda.synchronize()
                dt = time.perf_counter() - t0
                if profiler.after_step(self.step) and self.rank == 0:
                    (progress.write if progress else print)(profiler.headline())
                if self.skipped_last_step:
                    self._nonfinite_step(loss, gnorm)
                losses.append(loss)
                grad_norms.append(gnorm)
                step_times.append(dt)
                self.data_times.append(data_dt)
                tps = tokens_per_step / self.world_size / dt
                if self.step % cfg.metrics.log_freq == 0 or self.step == t.steps:
                    logger.log(
                        self.step,
                        {
                            "loss": loss,
                            "grad_norm": gnorm,
                            "lr": self.lr_scheduler.get_last_lr()[0],
                            "step_time_s": dt,
                            "data_time_s": data_dt,
                            "tokens_per_sec_per_device": tps,
                            "mfu": fpt * tps / peak,
                            "memory_gib": peak_memory_gib(),
                        },
                    )
                if progress:
                    progress.set_postfix(loss=f"{loss:.4f}", tps=f"{tps:,.0f}")
                    progress.update(1)
                if self.checkpointer:
                    self.checkpointer.maybe_save(self.step)
                if self.step == self.start_step + 1:
                    # first step done (lazy init, compilation, PP shape inference): its memory peak is
                    # kept apart from the steady one, and the shorter timeout applies from now on
                    self.memory.first_step_done()
                    dist.barrier()
                    set_pg_timeouts(
                        cfg.comm.train_timeout_seconds, exclude=[self.checkpointer.pg] if self.checkpointer else []
                    )
                maybe_pause(self.step, self.out_dir, self.rank)  # fault-injection hook (tests)
                gc_at_steps.step(self.step)
        finally:
            gc_at_steps.close()
            profiler.close()
        wall = time.perf_counter() - wall0
        if progress:
            progress.close()
        if self.checkpointer:
            self.checkpointer.close()
        logger.close()
        record = result_record(self, losses, grad_norms, step_times, wall, tokens_per_step, fpt, peak)
        return {**record, "profile": profiler.summary} if profiler.summary else record


def parse_args(argv: list[str] | None = None) -> JobConfig:
    return parse_jobs(argv)[0]


def parse_jobs(argv: list[str] | None = None) -> list[JobConfig]:
    """One config per `--config` (the overrides apply to each); none given: the defaults."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", action="append", help="job config (.toml or .json); repeatable")
    known, overrides = parser.parse_known_args(argv)
    return [load_config(path, overrides) for path in (known.config or [None])]


def before_fork(argv: list[str]) -> None:
    """Called by recipes/forked_run.py before it forks the ranks: import what the jobs import lazily."""
    with contextlib.suppress(ConfigError):  # each rank's main() reports it
        import_for(parse_jobs(argv))


# Where this process's time went before the trainer (main() fills it; a grouped job has none).
STARTUP_S: dict[str, float] = {}


# Set by a launcher that imports the trainer once and forks the ranks (recipes/forked_run.py):
# its own age at the fork, which is the start-up and imports every rank inherits.
FORKED_AT_AGE_ENV = "TITAN_FORKED_AT_AGE_S"


def process_age_s() -> float | None:
    """Seconds since this process started (Linux /proc), i.e. interpreter start-up + imports so far;
    a forked rank adds the age its launcher had at the fork."""
    try:
        start_ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        age = float(Path("/proc/uptime").read_text().split()[0]) - start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None
    return age + float(os.environ.get(FORKED_AT_AGE_ENV, 0.0))


def run(cfg: JobConfig) -> dict:
    """Train with an already validated config inside an initialised process group."""
    t0 = time.perf_counter()
    cache_before = compile_cache.all_counts()
    trainer = Trainer(cfg)
    t_init = time.perf_counter() - t0
    record = trainer.train()
    if cfg.compile.enabled:  # a cold first step compiles: say whether the graphs came from the cache
        for cache, lookups in compile_cache.counts_of_all_ranks(cache_before).items():
            record[f"{cache}_cache_all_ranks"] = lookups
    steps = record["step_times_s"]
    # rank 0's time per phase: the first step pays lazy init and compilation; "other" is the
    # logger, checkpoint load and the record's gathers
    record["timings_s"] = {
        **STARTUP_S,
        "trainer_init": t_init,
        "first_step": steps[0] if steps else 0.0,
        "later_steps": sum(steps[1:]),
        "other": time.perf_counter() - t0 - t_init - sum(steps),
    }
    if trainer.rank == 0:
        write_result(cfg, record)
    return record


def main(argv: list[str] | None = None) -> int:
    STARTUP_S["process_start_and_imports"] = process_age_s()
    quiet_library_warnings()
    try:
        world = int(os.environ.get("WORLD_SIZE", 0)) or None
        cfgs = [validate(cfg, world) for cfg in parse_jobs(argv)]  # every job before any runs
        for cfg in cfgs:
            check_hardware(cfg)  # GPUs validate() cannot see: Float8 sm89+, AsyncTP (real mode)
        if any(cfg.comm != cfgs[0].comm for cfg in cfgs):
            raise ConfigError("comm: jobs launched together share one process group: their [comm] must match")
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    cfg = cfgs[0]
    if "RANK" not in os.environ and cfg.parallelism.world_size > 1:
        print(
            f"config error: parallelism: a world of {cfg.parallelism.world_size} ranks needs torchrun "
            f"(--nproc_per_node={cfg.parallelism.world_size}) or `run-recipe run`",
            file=sys.stderr,
        )
        return 2
    t0 = time.perf_counter()
    init_distributed(cfg)
    STARTUP_S["init_distributed"] = time.perf_counter() - t0  # the rendezvous: waits for the slowest rank
    try:
        for i, cfg in enumerate(cfgs):
            if len(cfgs) > 1:
                if i:  # a later job starts clean: its own compiled graphs (served by inductor's cache)
                    torch._dynamo.reset()
                    STARTUP_S.clear()  # its start-up was paid by the first job
                dist.barrier()  # the previous job's output is out before the marker
                if dist.get_rank() == 0:
                    print(f"{JOB_MARKER} {cfg.job.output_dir}", flush=True)
            run(cfg)
    except (CheckpointError, NonFiniteError, BadDocumentError) as e:
        # the project's own failures: raised alike on every rank, said once, in one line
        dump_flight_recorder(cfg, reason=f"{type(e).__name__}: {e}")
        if dist.get_rank() == 0:
            print(f"error: {e}", file=sys.stderr, flush=True)
        else:  # torchrun stops the group at the first exit: leave rank 0 the time to say it
            time.sleep(2)
        return 1
    except Exception as e:
        dump_flight_recorder(cfg, reason=f"{type(e).__name__}: {e}")  # gloo has no watchdog dump
        raise
    finally:
        dist.destroy_process_group()
    return 0


def exit_process(rc: int) -> None:
    """Exit a finished rank without the interpreter's teardown of torch's object graph: measured
    0.65 s of CPU per rank, 18 s for 16 ranks on 2 cores. atexit handlers and the streams still
    run and flush; a live non-daemon thread (one still writing) gets a normal exit instead. A
    rank forked by multiprocessing (recipes/forked_run.py) returns on success: its parent waits
    for the return value, and the fork's own exit skips the teardown anyway."""
    if rc == 0 and multiprocessing.parent_process() is not None:
        return
    if any(t.is_alive() and not t.daemon for t in threading.enumerate() if t is not threading.main_thread()):
        sys.exit(rc)
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)


if __name__ == "__main__":
    exit_process(main())
