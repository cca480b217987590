"""Launch the real trainer under torchrun for multi-process tests, and read its record.

Commands and environments come from recipes.launcher (the one place a torchrun command is built).
Independent jobs of one world size share one torchrun (`GROUPS`, recipes.studies.group_worker):
start-up (~10-20 s per torchrun on 2 cores) dominates the tiny jobs.
"""

from __future__ import annotations

import json
import os
import subprocess
import zlib
from collections.abc import Callable, Iterable
from pathlib import Path

import filelock

from core.config import load_config
from core.validate import validate
from recipes import launcher, modes

ROOT = Path(__file__).resolve().parents[1]

# A tiny fp32 job on a deterministic token stream: the shape every parity test starts from.
TINY_JOB = [
    "--model.flavor=tiny",
    "--data.dataset=synthetic",
    "--training.seq_len=64",
    "--training.local_batch_size=8",
    "--training.steps=10",
    "--optimizer.lr=1e-3",
    "--lr_scheduler.warmup_steps=2",
    "--metrics.progress=false",
]


def dist_env(nproc: int = 2) -> dict[str, str]:
    """The launcher's CPU environment, one thread per rank at every world size (the tests compare
    with in-process references)."""
    return modes.PROXY.env(nproc, OMP_NUM_THREADS="1")


torchrun_command = launcher.torchrun_command


def run_trainer(
    nproc: int, overrides: list[str], out_dir: Path, timeout: float = 600, env: dict[str, str] | None = None
) -> dict:
    """torchrun --standalone -m core.train (`env` added to the launch's); returns result.json.
    Raises with the log on failure."""
    out_dir.mkdir(parents=True, exist_ok=True)
    target = launcher.trainer_target(None, [f"--job.output_dir={out_dir}", *overrides])
    cmd = torchrun_command(nproc, target, forked=True)
    proc = subprocess.run(
        cmd,
        check=False,
        cwd=ROOT,
        env={**dist_env(nproc), **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    (out_dir / "log.txt").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-60:])
        raise RuntimeError(f"trainer failed (exit {proc.returncode}): {' '.join(cmd)}\n{tail}")
    return json.loads((out_dir / "result.json").read_text())


def once_per_session(key: str, tmp_path_factory, compute: Callable[[Path], dict]) -> dict:
    """`compute(folder)` once per pytest run, even where pytest-xdist splits the files among workers:
    the first worker to ask runs it under a file lock and leaves its JSON result in the run's shared
    temp folder; the others wait for the lock and read it. A compute that raises leaves nothing.
    The result is JSON either way, so a test reads the same types with or without workers."""
    if "PYTEST_XDIST_WORKER" not in os.environ:
        return json.loads(json.dumps(compute(tmp_path_factory.mktemp(key))))
    shared = tmp_path_factory.getbasetemp().parent / "shared"  # basetemp: <run>/popen-gw<N>, per worker
    shared.mkdir(exist_ok=True)
    done = shared / f"{key}.json"
    with filelock.FileLock(str(shared / f"{key}.lock")):
        if done.is_file():
            return json.loads(done.read_text())
        text = json.dumps(compute(shared / key))
        done.write_text(text)
        return json.loads(text)


def group_key(kind: str, world: int, names: Iterable[str]) -> str:
    """once_per_session's key of a group of jobs: the same jobs get the same key on every worker."""
    return f"{kind}_w{world}_{zlib.crc32(' '.join(sorted(names)).encode()):08x}"


def max_abs_diff(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b), (len(a), len(b))
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


def run_group(world: int, jobs: dict[str, list[str]], out: Path, strict: bool = True) -> dict[str, dict]:
    """One torchrun for all jobs of a world size (recipes.studies.group_worker runs each with
    core.train.run, one after another). Returns name -> result record; a job without a record
    raises (strict) or maps to {"error": its error and the log tail}."""
    specs = []
    for name, overrides in jobs.items():
        d = out / name
        validate(load_config(None, overrides), world, check_files=False)  # before spawning
        specs.append({"name": name, "overrides": [*overrides, f"--job.output_dir={d}"]})
    out.mkdir(parents=True, exist_ok=True)
    spec = out / f"jobs_w{world}.json"
    spec.write_text(json.dumps(specs))
    cmd = torchrun_command(world, ["-m", "recipes.studies.group_worker", str(spec)], forked=True)
    proc = subprocess.run(
        cmd, check=False, cwd=ROOT, env=dist_env(world), capture_output=True, text=True, timeout=900 + 300 * len(jobs)
    )
    (out / f"jobs_w{world}.log").write_text(proc.stdout + proc.stderr)
    records, missing = {}, []
    for name in jobs:
        f = out / name / "result.json"
        if f.is_file():
            records[name] = json.loads(f.read_text())
        else:
            missing.append(name)
            err = out / name / "error.txt"
            records[name] = {
                "error": (err.read_text() if err.is_file() else "no result.json")
                + "\n"
                + "\n".join((proc.stdout + proc.stderr).splitlines()[-60:])
            }
    if missing and strict:
        raise RuntimeError(f"no result for {missing} (exit {proc.returncode}):\n{records[missing[0]]['error']}")
    return records


class JobGroups:
    """Trainer jobs registered by the test modules (name -> world, overrides). The first record asked
    for runs every registered job of its world size in one torchrun (`run_group`); a job that
    failed fails only the tests that read it."""

    def __init__(self):
        self.jobs: dict[str, tuple[int, list[str]]] = {}
        self.records: dict[str, dict] = {}

    def add(self, world: int, jobs: dict[str, list[str]]) -> None:
        """Register jobs; names are folder names, unique in the session (prefix them by module)."""
        for name, overrides in jobs.items():
            assert self.jobs.get(name, (world, overrides)) == (world, overrides), f"two jobs named {name}"
            self.jobs[name] = (world, overrides)

    def get(self, name: str, tmp_path_factory) -> dict:
        if name not in self.records:
            world = self.jobs[name][0]
            group = {n: o for n, (w, o) in self.jobs.items() if w == world and n not in self.records}

            def run(out: Path) -> dict:
                return run_group(world, group, out, strict=False)

            self.records |= once_per_session(group_key("group", world, group), tmp_path_factory, run)
        rec = self.records[name]
        if "error" in rec:
            raise RuntimeError(f"{name}: the trainer job failed:\n{rec['error']}")
        return rec


GROUPS = JobGroups()  # one per pytest session: every module's jobs of a world size share a torchrun
