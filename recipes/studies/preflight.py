"""`run-recipe preflight`: the first command on a new node, before paying for many.

A few minutes of a small model through every feature the paper's rows need, each launched with
`recipes.launcher.torchrun_command`, and a plain verdict per feature:
- single process: the reference run, which also writes the seed checkpoint (one process).
- meta init: FSDP x TP x PP built on the meta device, each rank initialising its own shards;
  checked by a worker (`--worker init`): no two pipeline stages hold identical blocks, every
  rank of a stage sees the same whole tensors, shards of one tensor are not copies.
- 3D parity: FSDP 2 x TP 2 x PP 2 with Interleaved 1F1B on the meta path, loaded from the seed
  checkpoint, against the single-process losses.
- CP + compile + Float8 (its TP styles) + DCP: CP 2 x TP 2, compiled, Float8 (emulated where
  the hardware has no float8 matmuls), saving DCP checkpoints; then a resumed run that loads the
  last one and must continue.
Memory and throughput of each run are printed. What cannot run here is listed as skipped with
its reason (CPU: NCCL, AsyncTP, real Float8 matmuls). Exit 0 when every feature that can run passed.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import click

from recipes import launcher

STEPS = 6
PARITY_TOL = 1e-5  # fp32: only the summation order differs (as recipes/studies/parity.py)
BASE = ["--model.flavor=tiny4", "--data.dataset=synthetic", "--training.seq_len=64",
        "--training.local_batch_size=8", f"--training.steps={STEPS}", "--optimizer.lr=1e-3",
        "--lr_scheduler.warmup_steps=2", "--training.max_norm=0.3", "--metrics.progress=false", "--job.seed=0",
        "--training.mixed_precision_param=float32", "--training.mixed_precision_reduce=float32"]
LAYOUT_3D = ["--parallelism.dp_shard=2", "--parallelism.tp=2", "--parallelism.pp=2",
             "--parallelism.pp_schedule=Interleaved1F1B", "--training.local_batch_size=4"]
META = ["--model.init_device=meta"]


# ------------------------------------------------------------------------------ init worker
def _digest(t) -> str:
    return hashlib.sha256(t.detach().contiguous().float().cpu().numpy().tobytes()).hexdigest()[:16]


def init_report(overrides: list[str], per_stage: bool = True) -> dict | None:
    """Under torchrun: build the model on the meta path and describe what each rank holds.
    Rank 0 returns {"ranks": [{rank, pp_rank, stages: {stage: {param: (whole, local)}}}]}."""
    import torch  # local: `run-recipe --help` must not import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from core.build import build_model, schedule_stages
    from core.config import load_config, validate
    from core.models.args import model_args
    from core.parallel.mesh import ParallelDims
    from core.parallel.parallelize import Toggles
    from core.train import init_distributed, pipeline_loss

    cfg = validate(load_config(None, overrides), dist.get_world_size() if dist.is_initialized()
                   else int(os.environ.get("WORLD_SIZE", 1)), check_files=False)
    init_distributed(cfg)
    dims = ParallelDims.from_config(cfg.parallelism)
    mesh = dims.build_mesh("cpu", cfg.comm.init_timeout_seconds)
    torch.manual_seed(cfg.job.seed)
    parts, schedule = build_model(model_args(cfg, None), cfg, mesh, dims, torch.device("cpu"), Toggles(),
                                  pipeline_loss(cfg), per_stage_seed=per_stage)
    ids = [s.stage_index for s in schedule_stages(schedule)] if schedule is not None else [0]
    stages = {}
    for sid, part in zip(ids, parts):
        params = {}
        for name, p in part.named_parameters():
            whole = p.full_tensor() if isinstance(p, DTensor) else p
            local = p.to_local() if isinstance(p, DTensor) else p
            params[name] = (_digest(whole), _digest(local))
        stages[sid] = params
    mine = {"rank": dist.get_rank(), "pp_rank": mesh["pp"].get_local_rank(), "stages": stages}
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return {"ranks": everyone} if dist.get_rank() == 0 else None


def check_init(report: dict) -> list[str]:
    """What is wrong with an init_report (empty: nothing)."""
    problems = []
    by_stage: dict[int, dict[str, set]] = {}
    locals_: dict[tuple[int, str], dict[str, list[int]]] = {}  # local digest -> ranks
    for r in report["ranks"]:
        for sid, params in r["stages"].items():
            for name, (whole, local) in params.items():
                by_stage.setdefault(int(sid), {}).setdefault(name, set()).add(whole)
                locals_.setdefault((int(sid), name), {}).setdefault(local, []).append(r["rank"])
    for sid, params in sorted(by_stage.items()):
        for name, wholes in params.items():
            if len(wholes) != 1:
                problems.append(f"stage {sid}: ranks disagree on {name} ({len(wholes)} different values)")
    # blocks: the k-th block of every stage; depth-scaled weights differ by their scale alone, so
    # one weight drawn alike (wq: std 0.02 in every block) is a repeat
    seen: dict[tuple[int, str, str], int] = {}
    for sid, params in sorted(by_stage.items()):
        layers = sorted({n.split(".")[1] for n in params if n.startswith("layers.")}, key=int)
        for k, layer in enumerate(layers):
            for name, wholes in params.items():
                if not name.startswith(f"layers.{layer}.") or "norm" in name:
                    continue
                key = (k, name.split(".", 2)[2], next(iter(wholes)))
                if key in seen:
                    problems.append(f"stage {sid}: {name} (block {k}) repeats block {k} of stage {seen[key]}")
                seen.setdefault(key, sid)
    for (sid, name), shards in locals_.items():
        sharded = any(local != whole for local in shards for whole in by_stage[sid][name])
        if sharded and "norm" not in name and len(shards) == 1 and len(next(iter(shards.values()))) > 1:
            problems.append(f"stage {sid}: every shard of {name} holds the same values")
    return problems


def _worker_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m recipes.studies.preflight --worker init")
    parser.add_argument("--out", required=True)
    parser.add_argument("--same-seed-every-stage", action="store_true",
                        help="torch's lazy default (one seed broadcast to all): shows the defect")
    a, overrides = parser.parse_known_args(argv)
    import torch.distributed as dist  # local: as above
    from core.noise import quiet_library_warnings
    quiet_library_warnings()
    report = init_report(overrides, per_stage=not a.same_seed_every_stage)
    if report is not None:
        tmp = Path(a.out).with_suffix(".tmp")
        tmp.write_text(json.dumps(report))
        tmp.replace(a.out)
    dist.destroy_process_group()
    return 0


def run_init_check(world: int, overrides: list[str], out: Path, same_seed: bool = False,
                   timeout: float = 300) -> dict:
    """Launch the init worker on `world` CPU ranks; returns its report."""
    out.parent.mkdir(parents=True, exist_ok=True)
    target = ["-m", "recipes.studies.preflight", "--worker", "init", "--out", str(out),
              *(["--same-seed-every-stage"] if same_seed else []), *overrides]
    log = out.with_suffix(".log")
    rc = launcher.run_logged(launcher.torchrun_command(world, target),
                             launcher.launch_env("proxy", world, OMP_NUM_THREADS="1"), log, timeout=timeout)
    if rc != 0 or not out.is_file():
        raise RuntimeError(f"init worker failed (exit {rc}); log {log}:\n{launcher.log_tail(log)}")
    return json.loads(out.read_text())


if __name__ == "__main__":
    if sys.argv[1:3] == ["--worker", "init"]:
        sys.exit(_worker_main(sys.argv[3:]))
    sys.exit(f"usage: run-recipe preflight (this module's own entry is the torchrun worker)")
