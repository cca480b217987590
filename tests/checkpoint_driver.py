"""Run several trainer jobs one after another inside one torchrun group (for checkpoint tests).

Each job builds a fresh Trainer (mesh, model, optimizer, loader) from its own config, so a job
that resumes from another job's checkpoint gets everything it has from disk, while the group
pays torchrun's and torch's start-up once.

    python -m recipes.forked_run --standalone --nproc_per_node=4 -m tests.checkpoint_driver PLAN.json
    PLAN.json: {"jobs": [{"name": str, "overrides": ["--section.key=value", ...],
                          "env": {optional environment for this job}}, ...],
                "root": "<dir>"}   -> <root>/<name>/result.json per job

A job whose result.json exists is skipped, so a group restarted by torchrun (--max-restarts)
goes on with the job that was interrupted, which resumes from its own checkpoints.

Plan options for the checksum tests: "record_checksums": true writes, per job and rank, the
files that rank checksummed (<root>/<name>/checksums_rank_R.json); a job with "expect_error":
true that raises CheckpointError writes it to <root>/<name>/error_rank_R.txt and the group goes on.
"""

import json
import os
import sys
from pathlib import Path


def before_fork(argv: list[str]) -> None:
    """recipes/forked_run.py calls it before forking the ranks: the trainer, imported once."""
    import core.train  # noqa: F401


def main() -> None:
    import torch.distributed as dist

    from core.checkpoint import manifest
    from core.checkpoint.folder import CheckpointError
    from core.config import load_config
    from core.train import init_distributed, run
    from core.validate import validate

    plan = json.loads(Path(sys.argv[1]).read_text())
    world = int(os.environ.get("WORLD_SIZE", "1"))
    first = plan["jobs"][0]
    init_distributed(validate(load_config(None, first["overrides"]), world))
    hashed: list[str] = []
    if plan.get("record_checksums"):
        checksum = manifest.checksum
        manifest.checksum = lambda path: hashed.append(str(path)) or checksum(path)
    for job in plan["jobs"]:
        out = Path(plan["root"]) / job["name"]
        if (out / "result.json").exists():
            continue
        cfg = validate(load_config(None, [*job["overrides"], f"--job.output_dir={out}"]), world)
        os.environ.update(job.get("env", {}))
        try:
            run(cfg)
        except CheckpointError as e:
            if not job.get("expect_error"):
                raise
            out.mkdir(parents=True, exist_ok=True)
            (out / f"error_rank_{dist.get_rank()}.txt").write_text(str(e))
        for key in job.get("env", {}):
            del os.environ[key]
        if plan.get("record_checksums"):
            (out / f"checksums_rank_{dist.get_rank()}.json").write_text(json.dumps(hashed))
            hashed.clear()
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":  # DCP's process-based async save re-imports __main__
    main()
