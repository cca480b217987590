"""Peak activation memory per rank of a long-sequence proxy at CP 1, 2, 4 (the paper's Table 4
claim: context parallel divides the activation memory of one sequence by the CP degree).

    python -m recipes.cp_memory [--cp 1,2,4] [--seq 4096] [--flavor debug] [--out results/cp_activation_memory.json]

Each CP degree runs the real trainer (`core.train.Trainer`, FSDP over cp when cp > 1) under
torchrun on CPU: one warm-up step (optimizer state), then one step inside torch's
`MemTracker` (torch.distributed._tools.mem_tracker), which attributes every tensor alive in the
step to parameters, buffers, gradients, optimizer state, activations or temporaries. Reported
per rank: activation + temporary bytes at the step's peak, and the peak of all tracked memory.
Local batch 1, no activation checkpointing, so activations are all of one sequence's.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path


def _overrides(cp: int, seq: int, flavor: str) -> list[str]:
    return [f"--model.flavor={flavor}", "--data.dataset=synthetic", f"--training.seq_len={seq}",
            "--training.local_batch_size=1", "--training.steps=2", f"--parallelism.cp={cp}",
            "--parallelism.dp_shard=1", "--metrics.progress=false"]


def _worker(out: str, overrides: list[str]) -> int:
    import torch.distributed as dist
    from torch.distributed._tools.mem_tracker import MemTracker
    from core.config import load_config, validate
    from core.train import Trainer, init_distributed

    cfg = load_config(None, overrides)
    cfg = validate(cfg, int(os.environ.get("WORLD_SIZE", 1)), check_files=False)
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
            Path(out).write_text(json.dumps(every))
    finally:
        dist.destroy_process_group()
    return 0


def measure(cp: int, seq: int, flavor: str, tmp: Path) -> list[dict]:
    from recipes.launcher import launch_env, project_root
    out = tmp / f"cp{cp}.json"
    out.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes=1",
           f"--nproc_per_node={cp}", "-m", "recipes.cp_memory", "--worker", str(out), "--",
           *_overrides(cp, seq, flavor)]
    proc = subprocess.run(cmd, env=launch_env("proxy", cp), cwd=project_root(), capture_output=True, text=True)
    if proc.returncode != 0 or not out.is_file():
        raise RuntimeError(f"cp {cp} failed:\n" + "\n".join((proc.stdout + proc.stderr).splitlines()[-30:]))
    return json.loads(out.read_text())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--cp", default="1,2,4")
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--flavor", default="debug")
    ap.add_argument("--out", default="results/cp_activation_memory.json")
    ap.add_argument("rest", nargs="*")
    a = ap.parse_args(argv)
    if a.worker:
        return _worker(a.worker, a.rest)
    from tabulate import tabulate
    import tempfile
    rows, prev = [], None
    with tempfile.TemporaryDirectory() as tmp:
        for cp in (int(c) for c in a.cp.split(",")):
            ranks = measure(cp, a.seq, a.flavor, Path(tmp))
            act = max(r.get("Activation", 0) + r.get("Temp", 0) for r in ranks)
            total = max(r["Total"] for r in ranks)
            rows.append({"cp": cp, "seq_len": a.seq, "tokens_per_rank": a.seq // cp,
                         "activation_bytes_per_rank": act, "peak_tracked_bytes_per_rank": total,
                         "reduction_vs_previous": prev / act if prev else None, "per_rank": ranks})
            prev = act
    print(tabulate([[r["cp"], r["tokens_per_rank"], f"{r['activation_bytes_per_rank'] / 2**20:.1f}",
                     f"{r['peak_tracked_bytes_per_rank'] / 2**20:.1f}",
                     f"{r['reduction_vs_previous']:.2f}x" if r["reduction_vs_previous"] else ""] for r in rows],
                   headers=["cp", "tokens/rank", "activation+temp MiB/rank (at peak)", "peak tracked MiB/rank",
                            "reduction vs previous"]))
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"flavor": a.flavor, "method": "torch.distributed._tools.mem_tracker."
                                       "MemTracker, one training step after a warm-up step", "rows": rows},
                                      indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
