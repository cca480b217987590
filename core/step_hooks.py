"""What the training loop runs around its steps: Python's garbage collector on a schedule, and the
torch profiler over a window of steps (`[profiling]`), per rank."""

from __future__ import annotations

import csv
import datetime
import gc
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile, record_function

from core.config import Profiling
from core.group_timeouts import keep_own_timeout

TOP_OPS = 10  # ops per rank in the record (the files under the profile folder have them all)


class GCAtSteps:
    """Python's garbage collector every `freq` steps (a young-generation pass), never mid-step:
    an automatic collection inside a step walks the autograd graph's and the modules' objects."""

    def __init__(self, freq: int):
        self.freq, self.was_enabled = freq, gc.isenabled()
        if freq > 0:
            gc.disable()
            gc.collect(1)

    def step(self, step: int) -> None:
        if self.freq > 0 and step % self.freq == 0:
            gc.collect(1)

    def close(self) -> None:
        if self.was_enabled:
            gc.enable()


class StepProfiler:
    """torch.profiler over steps start_step .. start_step + steps - 1 of this rank. At the window's
    end each rank writes `rank<R>_trace.json` (Chrome trace: Perfetto or chrome://tracing) and
    `rank<R>_ops.txt` / `.csv` (ops by self time) under the folder, and `summary` holds every
    rank's top ops for the record (gathered: each rank ends the window at the same step, and the
    gather comes before the files are written, on a gloo group of `gather_timeout_s`: not under
    the training timeout, after 512 ranks each wrote a trace to a shared file system)."""

    def __init__(self, cfg: Profiling, out_dir: Path, rank: int, device_type: str, gather_timeout_s: float = 1800):
        self.cfg, self.rank, self.device_type = cfg, rank, device_type
        self.group = None
        if cfg.enabled and dist.is_initialized() and dist.get_world_size() > 1:  # every rank builds it
            self.group = keep_own_timeout(
                dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=gather_timeout_s))
            )
        self.folder = Path(out_dir) / cfg.folder
        self.first, self.last = cfg.start_step, cfg.start_step + cfg.steps - 1
        self.prof: profile | None = None
        self.span: record_function | None = None
        self.summary: dict | None = None

    def before_step(self, step: int) -> None:
        if not self.cfg.enabled or not self.first <= step <= self.last:
            return
        if step == self.first:
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device_type == "cuda" else [])
            self.prof = profile(activities=activities, record_shapes=self.cfg.record_shapes)
            self.prof.start()
            self.t0 = time.perf_counter()
        if self.prof is not None:
            self.span = record_function(f"step {step}")  # the step's own Python time is this span's self time
            self.span.__enter__()

    def after_step(self, step: int) -> bool:
        """True when this step closed the window (`summary` is then set)."""
        if self.prof is None:
            return False
        self.span.__exit__(None, None, None)
        if step == self.last:
            if self.device_type == "cuda":
                torch.cuda.synchronize()
            wall = time.perf_counter() - self.t0
            self.prof.stop()
            self.summary = self._write(wall)
            self.prof = None
            return True
        return False

    def close(self) -> None:
        """A run that ended inside the window (an error): stop the profiler, write nothing."""
        if self.prof is not None:
            self.prof.stop()
            self.prof = None

    def _write(self, wall: float) -> dict:
        device = self.device_type == "cuda"
        sort = "self_device_time_total" if device else "self_cpu_time_total"
        ops = self.prof.key_averages(group_by_input_shape=self.cfg.record_shapes)
        rows = sorted(ops, key=lambda e: getattr(e, sort), reverse=True)
        n = self.cfg.steps
        self_total = sum(getattr(e, sort) for e in rows) or 1.0
        mine = {
            "rank": self.rank,
            "wall_s_per_step": wall / n,
            "self_s_per_step": self_total / 1e6 / n,
            "top_ops": [
                {"op": e.key, "self_ms_per_step": getattr(e, sort) / 1e3 / n, "share": getattr(e, sort) / self_total}
                for e in rows[:TOP_OPS]
            ],
        }
        ranks = [mine]
        if self.group is not None:
            ranks = [None] * dist.get_world_size()
            dist.all_gather_object(ranks, mine, group=self.group)
        self._files(ops, rows, sort, device)
        return {
            "steps": [self.first, self.last],
            "time": "self device time" if device else "self CPU time (all threads of the rank)",
            "folder": str(self.folder),
            "ranks": ranks,
        }

    def _files(self, ops, rows, sort: str, device: bool) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        self.prof.export_chrome_trace(str(self.folder / f"rank{self.rank}_trace.json"))
        (self.folder / f"rank{self.rank}_ops.txt").write_text(ops.table(sort_by=sort, row_limit=-1) + "\n")
        n = self.cfg.steps
        with open(self.folder / f"rank{self.rank}_ops.csv", "w", newline="") as f:
            out = csv.writer(f)
            out.writerow(["op", "input_shapes", "calls_per_step", "self_ms_per_step", "total_ms_per_step"])
            for e in rows:
                shapes = str(e.input_shapes) if self.cfg.record_shapes else ""
                total = e.device_time_total if device else e.cpu_time_total
                out.writerow([e.key, shapes, e.count / n, getattr(e, sort) / 1e3 / n, total / 1e3 / n])

    def headline(self) -> str:
        """One line: rank 0's top ops and where the files are."""
        r0 = self.summary["ranks"][0]
        tops = ", ".join(f"{t['op']} {t['share']:.0%}" for t in r0["top_ops"][:4])
        return f"profile of steps {self.first}-{self.last}, rank 0 ({self.summary['time']}): {tops} -> {self.folder}"
