"""Runs several trainer jobs one after another inside one torchrun group.

    torchrun --nproc_per_node W -m recipes.studies.group_worker jobs.json

jobs.json: a list of {"name", "overrides"} (each with its own `--job.output_dir`). Every job is
validated before the group starts; a job that raises leaves `error.txt` in its output dir and
the next job still runs. Spares the ~10-20 s start-up of a torchrun per job (parity, tests).
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path

import torch.distributed as dist

from core.config import load_config
from core.lazy_imports import prepare_for_fork
from core.process import exit_process
from core.train import init_distributed, run
from core.validate import validate


def before_fork(argv: list[str]) -> None:
    """recipes/forked_run.py calls it before forking the ranks: the jobs' lazy imports and
    compile warm-up (core.lazy_imports.prepare_for_fork), once."""
    prepare_for_fork([load_config(None, job["overrides"]) for job in json.loads(Path(argv[0]).read_text())])


def main(spec: str) -> int:
    jobs = json.loads(Path(spec).read_text())
    world = int(os.environ.get("WORLD_SIZE", "1"))
    cfgs = [validate(load_config(None, job["overrides"]), world, check_files=False) for job in jobs]
    init_distributed(cfgs[0])
    try:
        for cfg in cfgs:
            try:
                run(cfg)
            except Exception as e:  # noqa: BLE001 - recorded; the next job still runs
                traceback.print_exc()
                if dist.get_rank() == 0:
                    (Path(cfg.job.output_dir) / "error.txt").write_text(f"{type(e).__name__}: {e}\n")
            dist.barrier()
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    exit_process(main(sys.argv[1]))
