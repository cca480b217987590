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

Read dumps: `python -m core.debug fr <dir>` (our summary: who left no dump, who is behind, in which
group, on which collective) or `... --torchfrtrace` (torch's analyser); both read a dump only through
an allowlist (`load_dump`: a crafted pickle is refused, naming the file). A collective that times out
names the rank(s) that never reached it, not the survivor (`report_failure`, `name_the_hung`).

Timeouts (as torchtitan): `comm.init_timeout_seconds` for process-group creation and the first
step (lazy init, compilation), then `set_pg_timeouts(comm.train_timeout_seconds)` on every group
but those made with a timeout of their own (core/group_timeouts.py: the checkpoint's, its async
save's poll group, the profiler's gather group). A compiled
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
import io
import json
import os
import pickle
import re
import shlex
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
from core.jobs import rank_prefix
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
    data = pickle.loads(raw)  # torch's own bytes, from this process's memory: no file anyone could craft
    config = data.get("pg_config") or {}
    if not any(v.get("ranks", "[]") != "[]" for v in config.values()):
        data["pg_config"] = _pg_config()
    data["titan_reason"] = reason
    data["titan_launch"] = launch_id()  # which launch wrote it: a resumed run's folder keeps older dumps
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


# ------------------------------------------------------------------------ reading dumps safely
class UnsafeDump(ValueError):
    """A file that is not a Flight Recorder dump as torch or this project writes one: refused
    before anything in it runs (a pickle can name any callable; plain pickle would call it)."""


# torch's dumps (gloo and NCCL: one C++ recorder) and ours hold only dicts, lists, tuples, strings,
# numbers, booleans and None: no global at all (pickletools on torch 2.13's). torch's C++ pickler
# writes a typed list through these three, which only return the list they are given.
_LIST_BUILDERS = frozenset(("torch.jit._pickle", n) for n in ("build_intlist", "build_doublelist", "build_boollist"))


class _DumpUnpickler(pickle.Unpickler):
    """pickle's reader with no callable to call but `list` (torch's `weights_only` is the model)."""

    def find_class(self, module, name):
        if (module, name) in _LIST_BUILDERS:
            return list
        raise pickle.UnpicklingError(f"it names {module}.{name}, which no Flight Recorder dump does")

    def persistent_load(self, pid):
        raise pickle.UnpicklingError("it holds a persistent id, which no Flight Recorder dump does")


def load_dump(data: bytes, name: str | os.PathLike) -> dict:
    """A Flight Recorder dump's content, read with the allowlist above; UnsafeDump names `name`."""
    try:
        out = _DumpUnpickler(io.BytesIO(data)).load()
    except Exception as e:  # noqa: BLE001 -- whatever a crafted or torn file raises, it is refused
        raise UnsafeDump(f"{name}: refused, not a Flight Recorder dump: {type(e).__name__}: {e}") from None
    if not isinstance(out, dict) or not isinstance(out.get("entries", []), list):
        raise UnsafeDump(f"{name}: refused, not a Flight Recorder dump: holds a {type(out).__name__}")
    return out


def read_traces(folder: str | os.PathLike) -> dict[int, dict]:
    """{rank: dump} of the `rank_N` files of a folder (NCCL's watchdog, or ours on gloo), and of
    our own `titan_rank_N` (CUDA) for ranks the watchdog did not dump. Read with `load_dump`:
    a file that is not a dump raises UnsafeDump, naming it."""
    out = {}
    for prefix in (OWN_PREFIX, FR_PREFIX):  # the watchdog's dump wins where both exist
        for f in sorted(Path(folder).glob(f"{prefix}*")):
            suffix = f.name[len(prefix) :]
            if suffix.isdigit():
                out[int(suffix)] = load_dump(f.read_bytes(), f)
    if not out:
        raise FileNotFoundError(f"{folder}: no Flight Recorder dumps ({FR_PREFIX}N files)")
    return out


def world_of(traces: dict[int, dict]) -> list[int]:
    """Every rank of the job, as the dumps' process-group tables list them (and the dumps' own)."""
    ranks = set(traces)
    for d in traces.values():
        for g in (d.get("pg_config") or {}).values():
            try:
                ranks.update(int(r) for r in json.loads(g.get("ranks", "[]")))
            except (ValueError, TypeError, AttributeError):
                continue
    return sorted(ranks)


def _last_per_group(traces: dict[int, dict]) -> dict[str, dict]:
    """{group: {desc, last: {rank: its last entry in that group}}}."""
    groups: dict[str, dict] = {}
    for rank, d in traces.items():
        for e in d.get("entries", []):
            name, desc = e["process_group"]
            g = groups.setdefault(name, {"desc": desc, "last": {}})
            if e.get("collective_seq_id", 0) >= g["last"].get(rank, {}).get("collective_seq_id", -1):
                g["last"][rank] = e
    return groups


def analyze(traces: dict[int, dict]) -> dict:
    """Per group: each rank's last enqueued collective, and which ranks lag behind the rest
    (on a hang, they never issued the collective the others are blocked in). `missing`: ranks
    of the job with no dump, the prime suspects (a stopped or stuck rank cannot dump);
    `waiting_in`: the latest collective the ranks that dumped issued."""
    missing = sorted(set(world_of(traces)) - set(traces))
    report = {"ranks": sorted(traces), "missing": missing, "groups": {}, "lagging": [], "waiting_in": None}
    latest = -1
    for name, g in _last_per_group(traces).items():
        seqs = {r: e.get("collective_seq_id", 0) for r, e in g["last"].items()}
        top = max(seqs.values())
        behind = sorted(r for r, s in seqs.items() if s < top)
        ahead = sorted(r for r, s in seqs.items() if s == top)
        stuck = g["last"][ahead[0]]
        op = {"group": name, "desc": g["desc"], "op": stuck["profiling_name"], "seq": top}
        stuck_in = {"seq": top, "op": op["op"], "state": stuck.get("state"), "sizes": stuck.get("input_sizes")}
        report["groups"][name] = {"desc": g["desc"], "last_seq": seqs, "stuck_in": stuck_in}
        if (stuck.get("time_created_ns") or 0) > latest:
            latest, report["waiting_in"] = stuck.get("time_created_ns") or 0, op
        if behind:
            report["lagging"].append({**op, "ranks": behind, "waiting_ranks": ahead})
    return report


def _entry_line(rank: int, d: dict) -> str:
    ents, why = d.get("entries", []), (d.get("titan_reason") or "").splitlines()
    line = f"  rank {rank}: {len(ents)} entries"
    if ents:
        e, (group, desc) = ents[-1], ents[-1]["process_group"]
        seq = e.get("collective_seq_id")
        line += f", last {e['profiling_name']} seq {seq} in group {group} ({desc}), {e.get('state')}"
    return line + (f"; dumped on: {why[0][:160]}" if why else "")


def _lag_line(lag: dict) -> str:
    return (
        f"Rank(s) {lag['ranks']} never issued {lag['op']} #{lag['seq']} in group {lag['group']} "
        f"({lag['desc']}) that rank(s) {lag['waiting_ranks']} are waiting in."
    )


def ranks_named(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"


def suspects_line(report: dict) -> str | None:
    """One line naming the ranks the dumps point at (no dump first), or None when none is behind."""
    w, missing = report.get("waiting_in"), report.get("missing", [])
    if missing:
        where = f", last in {w['op']} #{w['seq']} of group {w['group']} ({w['desc']})" if w else ""
        return (
            f"{ranks_named(missing)} left no Flight Recorder dump: the prime suspect (a rank stopped, killed, "
            f"or stuck outside Python cannot dump); {ranks_named(report['ranks'])} dumped{where}"
        )
    return _lag_line(report["lagging"][0]) if report["lagging"] else None


def format_report(report: dict, traces: dict[int, dict]) -> str:
    lines = [f"Flight Recorder dumps of ranks {report['ranks']}"]
    lines += [_entry_line(r, d) for r, d in sorted(traces.items())]
    first = suspects_line(report)
    none = "No rank is behind: every rank dumped and issued the same last collective in every group."
    lines.append(first[:1].upper() + first[1:] if first else none)
    lines += [_lag_line(lag) for lag in report["lagging"][0 if report["missing"] else 1 :]]
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


# ------------------------------------------------------------------------------- a hung rank
# A collective that times out says nothing of the rank it waited for (gloo: "Timed out waiting
# 100000ms for recv operation to complete"), and a rank that is stopped or stuck never reports:
# the ranks that fail in a collective are the survivors (a timeout, or the connection a timed-out
# peer closed). Each writes a roll-call file, then waits for the others' (they fail within moments
# of each other: they block in the same step); the ranks missing are those that never reached it.
_TIMEOUT = re.compile(r"Timed out waiting (\d+)ms|[Ww]atchdog caught collective operation timeout")
_LOST = re.compile(r"Connection (?:closed|reset) by peer")
ROLL_CALL_S = 10.0  # how long a rank that failed in a collective waits for the other survivors
LOST_S = 3.0  # how long a rank that lost a connection waits for a timeout's report


def launch_id() -> str:
    """This launch and attempt (torchrun's run id and restart count), as a file name."""
    run = os.environ.get("TORCHELASTIC_RUN_ID", "local")
    return re.sub(r"[^\w.-]", "_", f"{run}.{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}")


def failed_in_collective(e: BaseException) -> bool:
    """A collective's timeout, or the connection a timed-out peer closed (gloo)."""
    return bool(_TIMEOUT.search(str(e)) or _LOST.search(str(e)))


def _roll_call(folder: Path, rank: int, world: int, said: str) -> dict[int, str]:
    """Write this rank's report, then wait for every rank's: {rank: its report}. At most ROLL_CALL_S;
    LOST_S while no rank has timed out (a lost connection alone is a peer that failed)."""
    atomic_write(folder / f"rank_{rank}", said)
    t0, reports = time.monotonic(), {}
    while True:
        for p in folder.glob("rank_*"):
            if p.name[5:].isdigit() and int(p.name[5:]) not in reports:
                reports[int(p.name[5:])] = p.read_text(errors="replace")
        waited, timed_out = time.monotonic() - t0, any(_TIMEOUT.search(t) for t in reports.values())
        if len(reports) >= world or waited >= ROLL_CALL_S or (waited >= LOST_S and not timed_out):
            return reports
        time.sleep(0.2)


def _fresh_traces(cfg) -> dict[int, dict]:
    """This launch's Flight Recorder dumps (a resumed run's folder keeps older ones)."""
    try:
        traces = read_traces(fr_folder(cfg))
    except (FileNotFoundError, UnsafeDump):
        return {}
    return {r: d for r, d in traces.items() if d.get("titan_launch") == launch_id()}


def report_failure(cfg, e: BaseException) -> bool:
    """A failed rank's report: its Flight Recorder dump (gloo has no watchdog to write one) and one
    error line for a collective that timed out (the rank(s) that never reached it, not this survivor)
    or a damaged compile cache file (moved aside). True when said (the caller exits 1), else False."""
    if dump_flight_recorder(cfg, reason=f"{type(e).__name__}: {e}"):
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # torchrun's SIGTERM must not replace the dump that says why
    said = name_the_hung(cfg, e) if failed_in_collective(e) else _cache_damage(e)
    if said:
        log.error(f"{rank_prefix()}error: {said}")
    return said is not None


def _cache_damage(e: BaseException) -> str | None:
    """A compile that failed on a damaged cache file: the file moved aside, and the line saying so."""
    from core.toggles.compile import damage_said  # light: inductor's modules load only if something compiled

    return damage_said(e) if "torch._inductor" in sys.modules else None


def name_the_hung(cfg, e: BaseException) -> str | None:
    """After this rank failed in a collective (a timeout, a lost connection): the error line naming
    the rank(s) that never reached it, from the Flight Recorder's dumps when it is on (a rank with
    no dump first), else from which ranks failed in it. "" on a rank that should stay quiet (a
    lower rank says it); None when no rank timed out (a peer failed: it says why) or every rank did."""
    rank, world = dist.get_rank(), dist.get_world_size()
    folder = Path(cfg.job.output_dir) / "debug" / "timeouts" / launch_id()  # atomic_write makes it
    try:
        reports = _roll_call(folder, rank, world, str(e).splitlines()[0] if str(e) else type(e).__name__)
    except OSError:  # the run folder cannot take it (a full disk): the failure as it is
        return None
    waited = next((m for text in reports.values() if (m := _TIMEOUT.search(text))), None)
    if waited is None:
        return None
    if min(reports) != rank:
        time.sleep(2)  # the lowest rank that failed says it: let it, before this rank's exit is seen
        return ""
    after = f" after {int(waited.group(1)) / 1000:g} s" if waited.group(1) else ""
    silent = sorted(set(range(world)) - set(reports))
    if cfg.comm.trace_buf_size > 0 and (traces := _fresh_traces(cfg)):
        report = analyze(traces)
        report["missing"] = sorted(set(range(world)) - set(traces))
        if line := suspects_line(report):
            see = f"python -m core.debug fr {shlex.quote(str(fr_folder(cfg)))}"
            return f"collective timeout{after}: {line.rstrip('.')}. See: {see}"
    if not silent:
        return None
    return (
        f"collective timeout{after}: {ranks_named(silent)} never reached the collective that "
        f"{ranks_named(sorted(reports))} failed in: hung (stopped, deadlocked, or stuck outside "
        "torch.distributed); to see where, rerun with --set comm.trace_buf_size=2000 (the Flight Recorder)"
    )


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
        traces = read_traces(a.folder)  # torch's analyser unpickles with plain pickle: ours vets every file first
        print(torchfrtrace(a.folder) if a.torchfrtrace else format_report(analyze(traces), traces))
    except (FileNotFoundError, UnsafeDump) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
