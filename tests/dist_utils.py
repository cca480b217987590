"""Launch the real trainer under torchrun for multi-process tests, and read its record.

Commands and environments come from recipes.launcher (the one place a torchrun command is built).
"""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

from recipes import launcher

ROOT = Path(__file__).resolve().parents[1]

# A tiny fp32 job on a deterministic token stream: the shape every parity test starts from.
TINY_JOB = [
    "--model.flavor=tiny", "--data.dataset=synthetic", "--training.seq_len=64",
    "--training.local_batch_size=8", "--training.steps=10", "--optimizer.lr=1e-3",
    "--lr_scheduler.warmup_steps=2", "--metrics.progress=false",
]


def dist_env(nproc: int = 2) -> dict[str, str]:
    """The launcher's CPU environment, one thread per rank at every world size (the tests compare
    with in-process references), and the checkout's persistent inductor cache unless one is set."""
    env = launcher.launch_env("proxy", nproc, OMP_NUM_THREADS="1")
    env.setdefault("TORCHINDUCTOR_CACHE_DIR", launcher.inductor_cache_dir())
    return env


torchrun_command = launcher.torchrun_command


def run_trainer(nproc: int, overrides: list[str], out_dir: Path, timeout: float = 600) -> dict:
    """torchrun --standalone -m core.train; returns result.json. Raises with the log on failure."""
    out_dir.mkdir(parents=True, exist_ok=True)
    cmd = torchrun_command(nproc, launcher.trainer_target(None, [f"--job.output_dir={out_dir}", *overrides]))
    proc = subprocess.run(cmd, check=False, cwd=ROOT, env=dist_env(nproc), capture_output=True, text=True,
                          timeout=timeout)
    (out_dir / "log.txt").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-60:])
        raise RuntimeError(f"trainer failed (exit {proc.returncode}): {' '.join(cmd)}\n{tail}")
    return json.loads((out_dir / "result.json").read_text())


def max_abs_diff(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b), (len(a), len(b))
    return max(abs(x - y) for x, y in zip(a, b))
