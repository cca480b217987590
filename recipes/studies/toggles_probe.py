"""The cold-compile probe of the toggle benchmarks: per-block vs whole-model compile timed in a fresh
process each (`cold_compile` runs this module with `python -m`, one compile mode per process)."""

from __future__ import annotations

import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time

import click
import torch
import torch.nn.functional as F

from core.config import Compile
from core.models.llama3 import FLAVORS, create_model
from core.parallel.parallelize import Toggles
from core.toggles.compile import apply_compile
from recipes import modes, paths

PROBE_MODULE = "recipes.studies.toggles_probe"  # run as `python -m` for a cold-compile probe


def _cpu_s() -> float:
    """CPU seconds of this process and its reaped children (gcc): less load-sensitive than wall."""
    c = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + c.ru_utime + c.ru_stime


def _compile_probe(mode: str, flavor: str, seq_len: int, batch: int, steps: int = 4) -> dict:
    """(In a fresh process.) Time the first training step, which compiles, and the later ones."""
    model = create_model(flavor, vocab_size=4352, max_seq_len=seq_len, device="cpu")
    if mode == "block":
        apply_compile(model, Compile(enabled=True), Toggles(), "cpu")
    elif mode == "whole":
        model = torch.compile(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    g = torch.Generator().manual_seed(0)
    wall, cpu = [], []
    for _ in range(steps):
        tokens = torch.randint(0, 4352, (batch, seq_len + 1), generator=g)
        t0, c0 = time.perf_counter(), _cpu_s()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(tokens[:, :-1])
        F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten(0, 1)).backward()
        opt.step()
        opt.zero_grad()
        wall.append(time.perf_counter() - t0)
        cpu.append(_cpu_s() - c0)
    return {
        "mode": mode,
        "first_step_s": wall[0],
        "steady_step_s": statistics.median(wall[1:]),
        "compile_s": wall[0] - statistics.median(wall[1:]),
        "compile_cpu_s": cpu[0] - statistics.median(cpu[1:]),
    }


def cold_compile(flavor: str = "debug", seq_len: int = 256, batch: int = 8) -> dict:
    """Cold compile (first step minus a steady step, wall and CPU time) of per-block vs whole-model
    compile, each in a fresh process on an empty inductor cache; then per-block again on the cache
    it filled. Inductor compiles in-process (COMPILE_THREADS=1) so its CPU time is counted."""
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for key, mode, cache in (
            ("block_cold", "block", "block"),
            ("whole_cold", "whole", "whole"),
            ("block_warm", "block", "block"),
        ):
            env = modes.PROXY.env(1, TORCHINDUCTOR_CACHE_DIR=f"{tmp}/{cache}", TORCHINDUCTOR_COMPILE_THREADS="1")
            cmd = [
                sys.executable,
                "-m",
                PROBE_MODULE,
                "--probe",
                mode,
                "--flavor",
                flavor,
                "--seq-len",
                str(seq_len),
                "--batch",
                str(batch),
            ]
            proc = subprocess.run(
                cmd, check=False, capture_output=True, text=True, env=env, cwd=paths.project_root(), timeout=1800
            )
            lines = [line for line in proc.stdout.splitlines() if line.startswith("PROBE ")]
            if proc.returncode or not lines:
                raise RuntimeError(f"compile probe {mode} failed:\n{proc.stderr[-3000:]}")
            out[key] = json.loads(lines[-1][6:])
    out["n_layers"] = FLAVORS[flavor].n_layers
    out["whole_over_block"] = out["whole_cold"]["compile_s"] / out["block_cold"]["compile_s"]
    out["whole_over_block_cpu"] = out["whole_cold"]["compile_cpu_s"] / out["block_cold"]["compile_cpu_s"]
    out["warm_over_cold"] = out["block_warm"]["compile_s"] / out["block_cold"]["compile_s"]
    return out


@click.command("toggles-probe")
@click.option("--probe", type=click.Choice(["eager", "block", "whole"]), required=True, help="The compile mode.")
@click.option("--flavor", default="debug")
@click.option("--seq-len", type=int, default=256)
@click.option("--batch", type=int, default=8)
def main(probe, flavor, seq_len, batch):
    """(In a fresh process, for cold_compile.) Time one compile mode and print PROBE <json>."""
    click.echo("PROBE " + json.dumps(_compile_probe(probe, flavor, seq_len, batch)))


if __name__ == "__main__":  # the cold-compile probe (a fresh process per compile mode)
    main()
