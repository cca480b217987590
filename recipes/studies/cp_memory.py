"""Peak activation memory per rank of a long-sequence proxy at CP 1, 2, 4 (the paper's Table 4
claim: context parallel divides the activation memory of one sequence by the CP degree).

    run-recipe cp-memory [--cp 1,2,4] [--seq 4096] [--flavor debug] [--out results/cp_activation_memory.json]

Each CP degree runs the real trainer (`core.train.Trainer`, FSDP over cp when cp > 1) under
torchrun on CPU: one warm-up step (optimizer state), then one step inside torch's
`MemTracker` (torch.distributed._tools.mem_tracker), which attributes every tensor alive in the
step to parameters, buffers, gradients, optimizer state, activations or temporaries. Reported
per rank: activation + temporary bytes at the step's peak, and the peak of all tracked memory.
Local batch 1, no activation checkpointing, so activations are all of one sequence's.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import click
import torch.distributed as dist
from tabulate import tabulate
from torch.distributed._tools.mem_tracker import MemTracker

from core.config import load_config
from core.fileio import atomic_write_json
from core.train import Trainer, init_distributed
from core.validate import validate
from recipes import launcher, modes, options, paths
from recipes.studies.common import synthetic_job

WORKER = "recipes.studies.cp_memory"  # each rank of a measurement runs this module's __main__


def _overrides(cp: int, seq: int, flavor: str) -> list[str]:
    return synthetic_job(flavor, seq, 1, 2, f"--parallelism.cp={cp}", "--parallelism.dp_shard=1")


def _worker(out: str, overrides: list[str]) -> int:
    cfg = load_config(None, overrides)
    cfg = validate(cfg, int(os.environ.get("WORLD_SIZE", "1")), check_files=False)
    init_distributed(cfg)
    try:
        trainer = Trainer(cfg)
        data = iter(trainer.dataloader)
        trainer.train_step([next(data)])  # optimizer state exists before tracking
        tracker = MemTracker()
        tracker.track_external(*trainer.model_parts, trainer.optimizer)
        batch = next(data)
        with tracker:
            trainer.train_step([batch])
        (snap,) = tracker.get_tracker_snapshot("peak").values()
        mine = {k: int(v) for k, v in snap.items()}
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)
        if dist.get_rank() == 0:
            atomic_write_json(out, every, indent=None)
    finally:
        dist.destroy_process_group()
    return 0


def measure(cp: int, seq: int, flavor: str, tmp: Path) -> list[dict]:
    out = tmp / f"cp{cp}.json"
    out.unlink(missing_ok=True)
    cmd = launcher.torchrun_command(cp, ["-m", WORKER, "--worker", str(out), "--", *_overrides(cp, seq, flavor)])
    log = tmp / f"cp{cp}.log"
    rc = launcher.run_logged(cmd, modes.PROXY.env(cp), log)
    if rc != 0 or not out.is_file():
        raise RuntimeError(f"cp {cp} failed:\n" + launcher.log_tail(log))
    return json.loads(out.read_text())


@click.command("cp-memory")
@click.option("--cp", "cps", default="1,2,4", show_default=True, help="CP degrees, comma-separated.")
@click.option("--seq", type=int, default=4096, show_default=True)
@click.option("--flavor", default="debug", show_default=True)
@options.out_file_option("The JSON (default: results/cp_activation_memory.json).")
@click.option("--worker", hidden=True, help="(Inside torchrun.) Measure one CP degree, write this file.")
@click.argument("overrides", nargs=-1)
def cp_memory(cps, seq, flavor, out, worker, overrides):
    """Peak activation memory per rank of a long-sequence proxy at CP 1, 2, 4 (MemTracker)."""
    if worker:
        raise SystemExit(_worker(worker, list(overrides)))
    out = Path(out) if out else paths.results_root() / "cp_activation_memory.json"
    rows, prev = [], None
    with tempfile.TemporaryDirectory() as tmp:
        for cp in (int(c) for c in cps.split(",")):
            ranks = measure(cp, seq, flavor, Path(tmp))
            act = max(r.get("Activation", 0) + r.get("Temp", 0) for r in ranks)
            total = max(r["Total"] for r in ranks)
            rows.append(
                {
                    "cp": cp,
                    "seq_len": seq,
                    "tokens_per_rank": seq // cp,
                    "activation_bytes_per_rank": act,
                    "peak_tracked_bytes_per_rank": total,
                    "reduction_vs_previous": prev / act if prev else None,
                    "per_rank": ranks,
                }
            )
            prev = act
    click.echo(
        tabulate(
            [
                [
                    r["cp"],
                    r["tokens_per_rank"],
                    f"{r['activation_bytes_per_rank'] / 2**20:.1f}",
                    f"{r['peak_tracked_bytes_per_rank'] / 2**20:.1f}",
                    f"{r['reduction_vs_previous']:.2f}x" if r["reduction_vs_previous"] else "",
                ]
                for r in rows
            ],
            headers=[
                "cp",
                "tokens/rank",
                "activation+temp MiB/rank (at peak)",
                "peak tracked MiB/rank",
                "reduction vs previous",
            ],
        )
    )
    atomic_write_json(
        out,
        {
            "flavor": flavor,
            "method": "torch.distributed._tools.mem_tracker.MemTracker, one training step after a warm-up step",
            "rows": rows,
        },
        indent=1,
    )


if __name__ == "__main__":  # torchrun -m recipes.studies.cp_memory --worker OUT -- OVERRIDES (measure's ranks)
    cp_memory()
