"""Failure signals: collective timeouts, the Flight Recorder, and fault-injection hooks for tests.

Flight Recorder (`comm.trace_buf_size` > 0): torch keeps the last N collectives of every
process group per rank. `setup_flight_recorder` sets the environment before the process group
exists; NCCL's watchdog then dumps on a timeout to `<output_dir>/<comm.fr_dump_folder>/rank_N`
by itself (TORCH_NCCL_DUMP_ON_TIMEOUT + TORCH_FR_DUMP_TEMP_FILE). Our own dumps on CUDA (a failed
step, SIGTERM) read NCCL's recorder and go to `titan_rank_N`, never the watchdog's file. Gloo records collectives too
but has no watchdog: the trainer calls `dump_flight_recorder` when a step fails (a gloo timeout
is a RuntimeError) and on SIGTERM (torchrun stopping the surviving ranks), to the same files.
Gloo entries stay "scheduled" (no completion times) and their dumps carry no process-group
table, which `dump_flight_recorder` fills in so torch's `torchfrtrace` can read them.

Read dumps: `python -m core.debug fr <dir>` (our summary: who is behind, in which group, on
which collective) or `python -m core.debug fr <dir> --torchfrtrace` (torch's analyser).

Timeouts (as torchtitan): `comm.init_timeout_seconds` for process-group creation and the first
step (lazy init, compilation), then `set_pg_timeouts(comm.train_timeout_seconds)` on every group
but the checkpoint's (`comm.checkpoint_timeout_seconds`, core/checkpoint/collectives.py). A compiled
pipeline's first step compiles rank after rank, so its timeout grows with pp (`first_step_timeout`,
stated in the result record).

Fault injection (tests; environment, first launch attempt only):
  TITAN_DEBUG_PAUSE="STEP:SECONDS[:RANK,RANK...]"  after STEP (and its checkpoint) the listed
      ranks (default: all) write `<output_dir>/debug/pid_rank_R` and sleep SECONDS, so a test
      can SIGKILL a real rank mid-run, or hold one back to trigger a collective timeout.
"""

from __future__ import annotations

import argparse
import datetime
import os
import pickle
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _set_pg_timeout, _world  # private: group registry, timeout setter

from core.fileio import atomic_write
from core.logs import get_logger

log = get_logger(__name__)

FR_PREFIX = "rank_"  # NCCL's watchdog dump (TORCH_FR_DUMP_TEMP_FILE + rank), and ours on gloo
OWN_PREFIX = "titan_rank_"  # our own dumps on CUDA (failure, SIGTERM): never the watchdog's file
PAUSE_ENV = "TITAN_DEBUG_PAUSE"


# ----------------------------------------------------------------------------------- timeouts
# One pipeline stage's cold compile (its block graph, forward and backward; one graph serves every
# block and stage of a rank). Measured by scripts/pp_cold_compile.py (results/pp_cold_compile.json:
# torch 2.13 CPU, inductor's C++ and gcc, each rank on its own empty cache; compile + full AC + bf16
# + Float8 emulated) at pp 2 x 2 blocks, pp 2 x 4 blocks and pp 4 x 2 blocks: per stage, not per
# block. The constant is more than twice the largest there: the 405B rows' GPU graphs (Triton
# kernels, AsyncTP's split matmuls, TP collectives) were not measured here.
COLD_STAGE_COMPILE_S = 120


class FirstStepTimeout(NamedTuple):
    seconds: float
    reason: str


def first_step_timeout(cfg) -> FirstStepTimeout:
    """The timeout of every group until the first step is done. A compiled pipeline's first step
    runs in pipeline order, each rank compiling before the next can go on: torch's dynamic shape
    inference (a forward and backward of each stage in turn, ranks blocked in recv_object_list)
    or, with parallelism.pp_static_shapes, the first microbatch itself. The last rank waits for
    about pp cold compiles, on top of what comm.init_timeout_seconds covers."""
    base, p = cfg.comm.init_timeout_seconds, cfg.parallelism
    if p.pp == 1 or not cfg.compile.enabled:
        return FirstStepTimeout(base, "comm.init_timeout_seconds")
    how = "static shapes: the first microbatch" if p.pp_static_shapes else "dynamic shape inference"
    return FirstStepTimeout(
        base + p.pp * COLD_STAGE_COMPILE_S,
        f"comm.init_timeout_seconds ({base} s) + pp {p.pp} x {COLD_STAGE_COMPILE_S} s (one stage's cold "
        f"compile, core.debug.COLD_STAGE_COMPILE_S): the first step compiles stage after stage ({how})",
    )


def set_pg_timeouts(seconds: float, exclude=()) -> int:
    """Set the timeout of every process group this rank belongs to (except `exclude`).
    Returns how many groups were changed."""
    timeout = datetime.timedelta(seconds=seconds)
    skip = {id(g) for g in exclude if g is not None}
    n = 0
    for pg in list(_world.pg_map):
        if id(pg) in skip:
            continue
        _set_pg_timeout(timeout, pg)
        n += 1
    return n


def pg_timeout_seconds(pg=None) -> float:
    """The timeout a group's backend currently applies (for checks and tests)."""
    # private: a backend's applied timeout has no public reader
    pg = pg or dist.group.WORLD
    backend = pg._get_backend(torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    return backend.options._timeout.total_seconds()


# ------------------------------------------------------------------------------ flight recorder
def fr_folder(cfg) -> Path:
    return Path(cfg.job.output_dir) / cfg.comm.fr_dump_folder


def setup_flight_recorder(cfg) -> Path | None:
    """Environment for the Flight Recorder; call before init_process_group."""
    if cfg.comm.trace_buf_size <= 0:
        return None
    folder = fr_folder(cfg)
    folder.mkdir(parents=True, exist_ok=True)
    size = str(cfg.comm.trace_buf_size)
    os.environ["TORCH_FR_BUFFER_SIZE"] = size
    os.environ["TORCH_NCCL_TRACE_BUFFER_SIZE"] = size  # the name torch < 2.7 reads
    os.environ["TORCH_NCCL_DUMP_ON_TIMEOUT"] = "1"
    os.environ["TORCH_FR_DUMP_TEMP_FILE"] = str(folder / FR_PREFIX)  # torch appends the rank
    os.environ["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] = str(folder / FR_PREFIX)  # older name
    return folder


def _pg_config() -> dict:
    """{group name: {name, desc, ranks}} of every group, the table gloo dumps leave empty."""
    out = {}
    for pg in list(_world.pg_map):
        try:
            ranks = dist.get_process_group_ranks(pg)
        except (RuntimeError, ValueError, KeyError):
            continue
        out[pg.group_name] = {"name": pg.group_name, "desc": getattr(pg, "group_desc", ""), "ranks": str(sorted(ranks))}
    return out


def dump_flight_recorder(cfg, reason: str = "") -> Path | None:
    """Write this rank's Flight Recorder buffer to `<fr folder>/rank_<R>` (pickle, torch's
    format). No-op when disabled or without a process group."""
    if cfg.comm.trace_buf_size <= 0 or not dist.is_initialized():
        return None
    try:
        return _dump(cfg, reason)
    except Exception as e:  # noqa: BLE001 -- never hide the failure that led here
        log.warning(f"[debug] Flight Recorder dump failed: {type(e).__name__}: {e}")
        return None


def _dump(cfg, reason: str) -> Path:
    rank = dist.get_rank()
    cuda = torch.cuda.is_available()
    # CUDA: NCCL's own recorder (completion states, its process-group table); gloo: the generic one.
    # Private bindings: the flight recorder's dumps have no public Python API.
    c10d = torch._C._distributed_c10d
    dump = getattr(c10d, "_dump_nccl_trace", None) if cuda else None
    raw = (dump or c10d._dump_fr_trace)()
    data = pickle.loads(raw)
    config = data.get("pg_config") or {}
    if not any(v.get("ranks", "[]") != "[]" for v in config.values()):
        data["pg_config"] = _pg_config()
    data["titan_reason"] = reason
    folder = fr_folder(cfg)
    folder.mkdir(parents=True, exist_ok=True)
    # NCCL's watchdog may write rank_<R> at the same moment (a timeout then SIGTERM): our own name
    path = folder / f"{OWN_PREFIX if cuda else FR_PREFIX}{rank}"
    return atomic_write(path, pickle.dumps(data))


def dump_on_sigterm(cfg) -> None:
    """torchrun stops the surviving ranks with SIGTERM: leave their buffers on disk first."""
    if cfg.comm.trace_buf_size <= 0:
        return

    def handler(signum, frame):
        try:
            dump_flight_recorder(cfg, reason="SIGTERM")
        finally:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)

    signal.signal(signal.SIGTERM, handler)


def read_traces(folder: str | os.PathLike) -> dict[int, dict]:
    """{rank: dump} of the `rank_N` files of a folder (NCCL's watchdog, or ours on gloo), and of
    our own `titan_rank_N` (CUDA) for ranks the watchdog did not dump."""
    out = {}
    for prefix in (OWN_PREFIX, FR_PREFIX):  # the watchdog's dump wins where both exist
        for f in sorted(Path(folder).glob(f"{prefix}*")):
            suffix = f.name[len(prefix) :]
            if suffix.isdigit():
                with open(f, "rb") as fh:
                    out[int(suffix)] = pickle.load(fh)
    if not out:
        raise FileNotFoundError(f"{folder}: no Flight Recorder dumps ({FR_PREFIX}N files)")
    return out


def analyze(traces: dict[int, dict]) -> dict:
    """Per group: each rank's last enqueued collective, and which ranks lag behind the rest
    (on a hang, they never issued the collective the others are blocked in)."""
    groups: dict[str, dict] = {}
    for rank, d in traces.items():
        for e in d.get("entries", []):
            name, desc = e["process_group"]
            g = groups.setdefault(name, {"desc": desc, "last": {}, "ops": {}})
            seq = e.get("collective_seq_id", 0)
            if seq >= g["last"].get(rank, (-1,))[0]:
                g["last"][rank] = (seq, e["profiling_name"], e.get("state"), e.get("input_sizes"))
            g["ops"][(rank, seq)] = e["profiling_name"]
    report = {"ranks": sorted(traces), "groups": {}, "lagging": []}
    for name, g in groups.items():
        seqs = {r: v[0] for r, v in g["last"].items()}
        top = max(seqs.values())
        behind = sorted(r for r, s in seqs.items() if s < top)
        ahead = [r for r, s in seqs.items() if s == top]
        stuck = g["last"][ahead[0]]
        report["groups"][name] = {
            "desc": g["desc"],
            "last_seq": seqs,
            "stuck_in": {"seq": stuck[0], "op": stuck[1], "state": stuck[2], "sizes": stuck[3]},
        }
        if behind:
            report["lagging"].append(
                {
                    "group": name,
                    "desc": g["desc"],
                    "ranks": behind,
                    "waiting_ranks": sorted(ahead),
                    "op": stuck[1],
                    "seq": stuck[0],
                }
            )
    return report


def format_report(report: dict, traces: dict[int, dict]) -> str:
    lines = [f"Flight Recorder dumps of ranks {report['ranks']}"]
    for r, d in sorted(traces.items()):
        ents = d.get("entries", [])
        last = ents[-1] if ents else None
        why = d.get("titan_reason") or ""
        lines.append(
            f"  rank {r}: {len(ents)} entries"
            + (
                f", last {last['profiling_name']} seq {last.get('collective_seq_id')} in group "
                f"{last['process_group'][0]} ({last['process_group'][1]}), {last.get('state')}"
                if last
                else ""
            )
            + (f"; dumped on: {why.splitlines()[0][:160]}" if why else "")
        )
    if not report["lagging"]:
        lines.append("No rank is behind: every rank issued the same last collective in every group.")
    for lag in report["lagging"]:
        lines.append(
            f"Rank(s) {lag['ranks']} never issued {lag['op']} #{lag['seq']} in group {lag['group']} "
            f"({lag['desc']}) that rank(s) {lag['waiting_ranks']} are waiting in."
        )
    return "\n".join(lines)


def torchfrtrace(folder: str | os.PathLike, *extra: str) -> str:
    """Run torch's own analyser (`torchfrtrace`) on a dump folder; returns what it printed.
    (A subprocess: its logger holds on to the stdout it found at import.)"""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.flight_recorder.fr_trace",
            str(folder),
            "--prefix",
            FR_PREFIX,
            *extra,
        ],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    return proc.stdout + proc.stderr


# ------------------------------------------------------------------------------ fault injection
def maybe_pause(step: int, output_dir: str | os.PathLike, rank: int) -> None:
    spec = os.environ.get(PAUSE_ENV)
    if not spec or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return
    parts = spec.split(":")
    at, seconds = int(parts[0]), float(parts[1])
    ranks = {int(r) for r in parts[2].split(",")} if len(parts) > 2 and parts[2] else None
    if step != at or (ranks is not None and rank not in ranks):
        return
    folder = Path(output_dir) / "debug"
    folder.mkdir(parents=True, exist_ok=True)
    atomic_write(folder / f"pid_rank_{rank}", str(os.getpid()))
    log.info(f"[debug] rank {rank} (pid {os.getpid()}) pausing {seconds:g} s after step {step}")
    time.sleep(seconds)


# ---------------------------------------------------------------------------------------- CLI
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m core.debug", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    fr = sub.add_parser("fr", help="summarise Flight Recorder dumps (rank_N files)")
    fr.add_argument("folder")
    fr.add_argument("--torchfrtrace", action="store_true", help="run torch's analyser instead")
    a = parser.parse_args(argv)
    try:
        if a.torchfrtrace:
            print(torchfrtrace(a.folder))
        else:
            traces = read_traces(a.folder)
            print(format_report(analyze(traces), traces))
    except FileNotFoundError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
