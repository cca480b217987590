"""Measure what one pipeline stage's cold compile costs, the basis of core.debug.COLD_STAGE_COMPILE_S.

Each case runs the trainer twice under torchrun on this machine: compiled, each rank on its own
empty inductor cache (as pp ranks on different nodes of a cluster, each with a node-local cache;
compile.shared_cache=off), and eager. The difference of their CPU seconds (every rank, inductor
compiling in-process, gcc included; CPU time rather than wall because the machine is shared) is
what compiling cost the pipeline; each pp rank compiles its stages' block graph once, so divided
by pp it is the cold compile of one stage. Cases vary pp and the blocks per stage: the per-stage
figure should stay flat in both (one graph serves every block of a rank). The first step's wall
time is printed too: the ranks compile one after another, so it grows with pp. One JSON line per case;
with --json, a report of every case naming the date, CPU, versions and commit.

    PYTHONPATH=$PWD python scripts/pp_cold_compile.py [--cases pp2_b2,pp2_b4,pp4_b2] [--json OUT]
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import click

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from recipes import launcher, modes  # noqa: E402 - after the path insert: run as a script

# The 405B rows' per-block toggles that run on CPU (compile, full AC, bf16; Float8 emulated);
# AsyncTP needs CUDA, TP and FSDP would add ranks compiling at once on a 2-core machine.
TOGGLES = [
    "--data.dataset=synthetic",
    "--training.seq_len=64",
    "--training.local_batch_size=8",
    "--training.steps=3",
    "--metrics.progress=false",
    "--training.mixed_precision_param=bfloat16",
    "--activation_checkpoint.mode=full",
    "--float8.enabled=true",
    "--float8.emulate=true",
    "--compile.shared_cache=off",
]
CASES = {  # name: (pp, flavor): blocks per stage = layers / pp
    "pp2_b2": (2, "tiny4"),
    "pp2_b4": (2, "tiny8"),
    "pp4_b2": (4, "tiny8"),
}


def _cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def _run(pp: int, flavor: str, compiled: bool, out: Path, cache: Path) -> dict:
    overrides = [
        *TOGGLES,
        f"--model.flavor={flavor}",
        f"--parallelism.pp={pp}",
        f"--parallelism.pp_microbatches={2 * pp}",
        f"--compile.enabled={str(compiled).lower()}",
        f"--job.output_dir={out}",
    ]
    env = modes.PROXY.env(pp, TORCHINDUCTOR_COMPILE_THREADS="1")
    cmd = launcher.torchrun_command(pp, [__file__, "--rank-cache", str(cache), "--", *overrides])
    cpu0, t0 = _cpu_s(), time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, check=False, timeout=3600)
    if proc.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    rec = json.loads((out / "result.json").read_text())
    return {"cpu_s": _cpu_s() - cpu0, "wall_s": time.perf_counter() - t0, "first_step_s": rec["step_times_s"][0]}


def _rank_main(cache: str, overrides: list[str]) -> int:
    """(A rank, under torchrun.) core.train on this rank's own inductor cache."""
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = f"{cache}/rank_{os.environ['RANK']}"
    from core.train import main as train

    return train(overrides)


@click.command()
@click.option("--cases", default=",".join(CASES), help=f"Comma-separated, of: {', '.join(CASES)}.")
@click.option("--rank-cache", default=None, help="(Internal: what each rank runs.) Train on CACHE/rank_R.")
@click.option("--json", "json_out", default=None, type=click.Path(dir_okay=False), help="Also write the report here.")
@click.argument("overrides", nargs=-1)
def main(cases: str, rank_cache: str | None, json_out: str | None, overrides: tuple[str, ...]) -> None:
    if rank_cache:
        sys.exit(_rank_main(rank_cache, list(overrides)))
    rows = []
    for name in cases.split(","):
        pp, flavor = CASES[name]
        with tempfile.TemporaryDirectory() as tmp:
            cold = _run(pp, flavor, True, Path(tmp) / "cold", Path(tmp) / "cache")
            eager = _run(pp, flavor, False, Path(tmp) / "eager", Path(tmp) / "cache")
        compile_cpu = cold["cpu_s"] - eager["cpu_s"]
        row = {"case": name, "pp": pp, "flavor": flavor, "compile_cpu_s": round(compile_cpu, 1)}
        row |= {"per_stage_cpu_s": round(compile_cpu / pp, 1), "cold": cold, "eager": eager}
        click.echo(json.dumps(row))
        rows.append(row)
    if json_out:
        from core.fileio import atomic_write_json
        from core.metrics import cpu_model
        from core.result import versions

        when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        report = {"what": __doc__.split("\n", 1)[0], "date": when, "cpu": cpu_model(), "versions": versions()}
        atomic_write_json(Path(json_out), {**report, "cases": rows}, indent=1)


if __name__ == "__main__":
    main()
