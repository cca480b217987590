"""One measured run of each trainer on the shared shape, and the CSV they are appended to.

The shape is torchtitan's Llama 3 debug model (dim 256, 6 layers, 16 heads, 16 KV heads, FFN
hidden 768, vocab 2,048) at seq 512 and local batch 8, FSDP2 over `nproc` gloo ranks with bf16
parameters and fp32 gradient reduction, no activation checkpointing, no compile. Ours trains on
the synthetic token stream, torchtitan on its C4-test-like corpus. The figure is each trainer's
own per-step tokens/s per rank, averaged over steps FIRST_STEADY..steps (step 1 builds and warms
up, step 2 still pays one-time costs).
"""

from __future__ import annotations

import csv
import datetime
import io
import json
import os
import re
import statistics
import tempfile
from pathlib import Path

from core.fileio import atomic_write
from recipes import launcher, modes, paths
from recipes.peer_bench import environment
from recipes.peer_bench.patches import TORCHTITAN_VERSION
from recipes.report.results import write_csv

FIRST_STEADY = 3
COLUMNS = ["date", "cpu", "trainer", "nproc", "round", "steps", "tokens_per_s_per_rank"]
PEER_NAME = f"torchtitan-{TORCHTITAN_VERSION}"
OURS_NAME = "titan-recipes"
SEED = 42
LR = 8e-4  # torchtitan's debug config

# torchtitan's `tps` log field, rank 0 (its validation lines say "validate step:")
_TPS_LINE = re.compile(r"(?<!validate )step:\s*(\d+)\b.*?\btps:\s*([\d,]+(?:\.\d+)?)")


def threads_per_rank(nproc: int) -> int:
    """Both trainers get the two cores: 2 threads for one process, 1 per rank otherwise."""
    return 2 if nproc == 1 else 1


def ours_overrides(steps: int, extra: tuple[str, ...] = ()) -> list[str]:
    """core.train overrides of the shared shape; `extra` (section.key=value) come last and win."""
    return [
        "--model.dim=256",
        "--model.n_layers=6",
        "--model.n_heads=16",
        "--model.n_kv_heads=16",
        "--model.vocab_size=2048",
        "--data.dataset=synthetic",
        "--training.seq_len=512",
        "--training.local_batch_size=8",
        f"--training.steps={steps}",
        "--training.mixed_precision_param=bfloat16",
        "--training.mixed_precision_reduce=float32",
        "--activation_checkpoint.mode=none",
        "--compile.enabled=false",
        f"--optimizer.lr={LR}",
        f"--job.seed={SEED}",
        "--metrics.progress=false",
        *(f"--{kv.removeprefix('--')}" for kv in extra),
    ]


def ours_name(extra: tuple[str, ...] = ()) -> str:
    """The CSV's trainer column: our runs name the overrides they were given."""
    return f"{OURS_NAME} ({' '.join(kv.removeprefix('--') for kv in extra)})" if extra else OURS_NAME


def torchtitan_args(nproc: int, steps: int, work: Path) -> list[str]:
    """torchtitan.train's command line for the shared shape, pointed at the local assets."""
    work = Path(work)
    return [
        "-m",
        "torchtitan.train",
        "--module",
        "llama3",
        "--config",
        "llama3_debugmodel",
        f"--hf-assets-path={work / 'tokenizer'}",
        f"--dataloader.dataset-path={work / 'c4_test'}",
        f"--dump-folder={work / 'outputs'}",
        "--training.seq-len=512",
        "--training.local-batch-size=8",
        f"--training.steps={steps}",
        "--training.mixed-precision-param=bfloat16",
        "--training.mixed-precision-reduce=float32",
        "--training.disable-cuda-graphs",
        f"--parallelism.data-parallel-shard-degree={nproc}",
        # 0.3.0's default SPMD backend (spmd_types) fails under torch 2.13 with more than one rank
        "--parallelism.spmd-backend=partial_dtensor",
        "--compile.no-enable",
        "--checkpoint.no-enable",
        "--validator.no-enable",
        f"--debug.seed={SEED}",
        "--metrics.disable-color-printing",
        "activation-checkpoint:none",  # tyro subcommand: the config's default is selective AC
    ]


def torchtitan_command(venv: Path, nproc: int, steps: int, work: Path, log_dir: Path) -> list[str]:
    """torchrun (the peer venv's) of torchtitan.train; rank 0's output on the console."""
    return launcher.torchrun_command(
        nproc,
        torchtitan_args(nproc, steps, work),
        exe=str(Path(venv) / "bin" / "torchrun"),
        launcher_args=[f"--log-dir={log_dir}", "--tee=3", "--local-ranks-filter=0"],
    )


def torchtitan_env(nproc: int, work: Path) -> dict[str, str]:
    """The peer's environment: none of our PYTHONPATH, CPU only, hub offline, caches in `work`."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(
        OMP_NUM_THREADS=str(threads_per_rank(nproc)),
        CUDA_VISIBLE_DEVICES="",
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        HF_HOME=str(Path(work) / "hf_home"),
        TORCHINDUCTOR_CACHE_DIR=str(Path(work) / "inductor"),
        PYTHONUNBUFFERED="1",
    )
    return env


def steady_mean(tps_by_step: dict[int, float], steps: int, source: str) -> float:
    """Mean tokens/s over steps FIRST_STEADY..steps; ValueError naming the source if one is missing."""
    missing = [s for s in range(FIRST_STEADY, steps + 1) if s not in tps_by_step]
    if missing:
        raise ValueError(f"{source}: no tokens/s for steps {missing}")
    return statistics.mean(tps_by_step[s] for s in range(FIRST_STEADY, steps + 1))


def torchtitan_tps(log_text: str) -> dict[int, float]:
    """{step: tps} from torchtitan's console log (the last value of a step wins)."""
    return {int(m[1]): float(m[2].replace(",", "")) for m in _TPS_LINE.finditer(log_text)}


def ours_tps(metrics_jsonl: Path) -> dict[int, float]:
    """{step: tokens/s per rank} from our trainer's metrics.jsonl."""
    rows = [json.loads(line) for line in Path(metrics_jsonl).read_text().splitlines() if line.strip()]
    return {int(r["step"]): float(r["tokens_per_sec_per_device"]) for r in rows}


def run_ours(nproc: int, steps: int, extra: tuple[str, ...] = ()) -> float:
    """core.train through the project's launcher; its mean steady tokens/s per rank."""
    work = environment.work_dir()
    work.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="ours-", dir=work) as out:
        threads = {"OMP_NUM_THREADS": str(threads_per_rank(nproc))}
        modes.launch_trainer(nproc, ours_overrides(steps, extra), out, env=threads)
        return steady_mean(ours_tps(Path(out) / "metrics.jsonl"), steps, "our metrics.jsonl")


def run_torchtitan(venv: Path, nproc: int, steps: int, tag: str) -> float:
    """torchtitan's trainer on the same shape; its mean steady tokens/s per rank. RuntimeError
    with the log's tail when it fails."""
    work = environment.work_dir()
    log_dir = work / "logs" / tag
    log_dir.mkdir(parents=True, exist_ok=True)
    console = log_dir / "console.log"
    cmd = torchtitan_command(venv, nproc, steps, work, log_dir / "ranks")
    rc = launcher.run_logged(cmd, torchtitan_env(nproc, work), console, cwd=work)
    if rc != 0:
        raise RuntimeError(f"torchtitan failed (exit {rc}); log {console}:\n{launcher.log_tail(console)}")
    return steady_mean(torchtitan_tps(console.read_text(errors="replace")), steps, str(console))


def utc_now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def csv_path() -> Path:
    return paths.results_root() / "peer_torchtitan.csv"


def append_rows(path: Path, rows: list[dict]) -> None:
    """Append rows in COLUMNS to the CSV. The existing bytes are kept as they are (its line ends
    too); the file is replaced whole (core.fileio). ValueError when the file's header is not
    COLUMNS (a file this command did not write). A new file is written as every harness CSV."""
    path = Path(path)
    if not path.is_file():
        write_csv(path, rows, COLUMNS)
        return
    old = path.read_bytes()
    first = old.split(b"\n", 1)[0]
    if first.rstrip(b"\r").decode().split(",") != COLUMNS:
        raise ValueError(f"{path}: columns {first.decode().strip()!r}, expected {','.join(COLUMNS)}; not appending")
    newline = "\r\n" if first.endswith(b"\r") else "\n"
    buf = io.StringIO()
    csv.DictWriter(buf, fieldnames=COLUMNS, lineterminator=newline, extrasaction="ignore").writerows(rows)
    sep = b"" if old.endswith(b"\n") else newline.encode()
    atomic_write(path, old + sep + buf.getvalue().encode())
