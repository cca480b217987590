"""Launching, the mechanics every mode shares (recipes/modes.py says how each mode uses them):
torchrun commands and the ranks' environment, a command run into a log, and the dry run in this
process. The machine check: recipes/hardware_check.py; the multi-node command and the sbatch
script: recipes/multinode.py; a row's config: recipes/registry.py `resolve_config`; its run
folder (made, owned, checked for a resume, its job and record): core/run_folder.py.

Nothing here trains: every run is torchrun (`python -m recipes.agent ...`) `-m core.train --config
<run_dir>/job.json`, and the trainer writes `<run_dir>/result.json` (the record).
"""

from __future__ import annotations

import datetime
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

from core.config import JobConfig
from core.fileio import atomic_write_json
from recipes.cluster_env import launch_env
from recipes.output import stream
from recipes.paths import project_root


class CannotRunHere(RuntimeError):
    """The mode cannot run on this machine / in this build (exit code 3)."""


def dry_run_available() -> bool:
    try:
        return importlib.util.find_spec("core.dryrun") is not None
    except ModuleNotFoundError:
        return False


# -------------------------------------------------------------------------------- commands
def torchrun_exe() -> str:
    exe = Path(sys.executable).with_name("torchrun")
    return str(exe) if exe.is_file() else "torchrun"


def torchrun_command(
    nproc: int,
    target: list[str] | tuple[str, ...],
    nnodes: int = 1,
    rdzv_id: str | None = None,
    rdzv_endpoint: str | None = None,
    max_restarts: int = 0,
    exe: str | None = None,
    launcher_args: list[str] | tuple[str, ...] = (),
    forked: bool = False,
) -> list[str]:
    """The one place a torchrun command is built. `target`: what each rank runs, e.g.
    `["-m", "core.train", "--config", path]` or a script and its arguments. One node without a
    rendezvous endpoint: `--standalone`; else a c10d rendezvous at `rdzv_endpoint`. `exe`: a
    torchrun executable (multi-node, sbatch); default torchrun's own agent in this interpreter,
    tethered to this process (`python -m recipes.agent`: it stops when we die). `max_restarts`:
    torchrun's agent restarts the whole group when a rank dies; the trainer resumes from its
    latest complete checkpoint (checkpoint.enabled).
    `launcher_args`: more torchrun options, after the rank counts (e.g. `--numa-binding=node`).
    `forked` (proxy runs: one node, `-m MODULE` target): the same options to recipes/forked_run.py,
    torchrun's agent with the ranks forked from a process that has imported MODULE once."""
    if forked:
        if exe or rdzv_endpoint is not None or nnodes != 1 or list(target[:1]) != ["-m"]:
            raise ValueError("a forked launch is one node, --standalone, of a `-m MODULE` target")
        exe_args = [sys.executable, "-u", "-m", "recipes.forked_run"]
    else:
        exe_args = [exe] if exe else [sys.executable, "-m", "recipes.agent"]  # torchrun, tethered
    cmd = list(exe_args)
    if rdzv_endpoint is None:
        cmd.append("--standalone")
    cmd += [f"--nnodes={nnodes}", f"--nproc_per_node={nproc}"]
    cmd += list(launcher_args)
    if rdzv_endpoint is not None:
        cmd += [f"--rdzv_id={rdzv_id}", "--rdzv_backend=c10d", f"--rdzv_endpoint={rdzv_endpoint}"]
    if max_restarts:
        cmd.append(f"--max-restarts={max_restarts}")
    return cmd + list(target)


def trainer_target(config_path: Path | str | None = None, overrides: list[str] | tuple[str, ...] = ()) -> list[str]:
    """What each rank of a training run executes: `-m core.train [--config PATH] [overrides]`."""
    return ["-m", "core.train", *(["--config", str(config_path)] if config_path else []), *overrides]


# ------------------------------------------------------------------------------ launching
def base_env(defaults: dict[str, str] | None = None, max_restarts: int = 0, **set_vars: str) -> dict[str, str]:
    """The environment of every torchrun this project starts: this one, the checkout on the
    path, recipes/cluster_env.py launch_env (the multi-node launches set the same list), the
    checkout's persistent inductor cache unless one is set. `defaults`: a mode's own settings,
    where the caller's environment has none; `set_vars` are set as given (e.g.
    OMP_NUM_THREADS="1" where a test compares against an in-process reference)."""
    env = dict(os.environ)
    root = str(project_root())
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    for key, value in {**launch_env(max_restarts), **(defaults or {})}.items():  # a mode's own first
        env.setdefault(key, value)
    # set from the start: torch's first cache lookup (at some imports) would fix its own default
    env.setdefault("TORCHINDUCTOR_CACHE_DIR", inductor_cache_dir())
    env.update(set_vars)
    return env


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity where the OS has one)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def inductor_cache_dir() -> str:
    """A persistent inductor cache in the checkout: compiled rows compile once per machine."""
    return str(project_root() / ".cache" / "inductor")


def run_logged(
    cmd: list[str],
    env: dict[str, str],
    log_path: Path,
    echo: bool = False,
    timeout: float | None = None,
    cwd: Path | None = None,
) -> int:
    """Run cmd with its merged output in log_path, echoed as it comes when `echo`. Returns the
    exit code (-1 after `timeout` seconds: the process is killed)."""
    if echo:
        return stream(cmd, env, log_path)
    with open(log_path, "wb") as f:
        try:
            return subprocess.run(
                cmd, check=False, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=cwd, timeout=timeout
            ).returncode
        except subprocess.TimeoutExpired:
            return -1


def log_tail(log_path: Path, lines: int = 30) -> str:
    return "\n".join(Path(log_path).read_text(errors="replace").splitlines()[-lines:])


def run_dry(
    cfg: JobConfig, run_dir: Path, gpu: str | None = None, fake: bool = True, software: str | None = None
) -> dict:
    """core.dryrun.record.dry_run at true scale (fake=False: the accounting without the fake
    step; `software`: --software's text); the record it returns, completed with our fields."""
    if not dry_run_available():
        raise CannotRunHere("dry-run is not available in this build (core.dryrun is missing)")
    from core.dryrun.record import dry_run  # imports torch: only when a dry-run is asked for
    from core.provenance import provenance
    from core.result import versions

    cfg.job.output_dir = str(run_dir)
    kwargs = {**({"gpu": gpu} if gpu else {}), **({} if fake else {"fake": False})}
    if software:
        from core.dryrun.software import parse

        kwargs["software"] = parse(software)
    record = dict(dry_run(cfg, **kwargs))
    record.setdefault("recipe", cfg.job.recipe)
    record.setdefault("mode", "dry-run")
    record.setdefault("config", cfg.to_dict())
    record.setdefault("provenance", provenance(cfg, read_assets=False))  # a dry-run reads no data
    record.setdefault("versions", versions())
    record.setdefault("finished_at", datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))
    atomic_write_json(run_dir / "result.json", record, default=str)
    return record


def dry_run_summary(record: dict) -> list[str]:
    """What a dry-run answers, in the lines `run-recipe run --mode dry-run` ends with: memory per
    rank and whether it fits, then the predicted throughput with its error band."""
    fits = "fits" if record.get("fits_gpu") else "does NOT fit"
    lines = [
        f"memory: {record.get('estimated_peak_memory_gib', 0):.2f} GiB per rank at its peak (estimated reserved; "
        f"allocated {record.get('allocated_peak_gib', 0):.2f}); the GPU holds "
        f"{record.get('gpu_capacity_gib', 0):.0f} GiB: {fits}"
    ]
    p = record.get("predicted") or {}
    if p.get("tokens_per_sec_per_gpu") is not None:
        lines.append(
            f"predicted on {p.get('gpu')}: {p['tokens_per_sec_per_gpu']:,.0f} tokens/s/GPU, MFU {p.get('mfu', 0):.1%}, "
            f"step {p.get('step_time_s', 0):.3f} s; error band {p.get('error_band', 'not known')}"
        )
    sw = record.get("software") or {}
    if sw.get("text"):
        lines.append(f"software: the prediction stands for {sw['text']} (core/dryrun/software.py; --software)")
    return lines
