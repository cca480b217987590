"""Run several trainer jobs one after another inside one torchrun group (for checkpoint tests).

Each job builds a fresh Trainer (mesh, model, optimizer, loader) from its own config, so a job
that resumes from another job's checkpoint gets everything it has from disk, while the group
pays torchrun's and torch's start-up once.

    torchrun --nproc_per_node=4 tests/checkpoint_driver.py PLAN.json
    PLAN.json: {"jobs": [{"name": str, "overrides": ["--section.key=value", ...],
                          "env": {optional environment for this job}}, ...],
                "root": "<dir>"}   -> <root>/<name>/result.json per job

A job whose result.json exists is skipped, so a group restarted by torchrun (--max-restarts)
goes on with the job that was interrupted, which resumes from its own checkpoints.
"""

import json
import os
import sys
from pathlib import Path


def main() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    # Imported after the path insert above: torchrun runs this file as a script from any directory.
    import torch.distributed as dist

    from core.config import load_config
    from core.train import init_distributed, run
    from core.validate import validate

    plan = json.loads(Path(sys.argv[1]).read_text())
    world = int(os.environ.get("WORLD_SIZE", "1"))
    first = plan["jobs"][0]
    init_distributed(validate(load_config(None, first["overrides"]), world))
    for job in plan["jobs"]:
        out = Path(plan["root"]) / job["name"]
        if (out / "result.json").exists():
            continue
        cfg = validate(load_config(None, [*job["overrides"], f"--job.output_dir={out}"]), world)
        os.environ.update(job.get("env", {}))
        run(cfg)
        for key in job.get("env", {}):
            del os.environ[key]
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":  # DCP's process-based async save re-imports __main__
    main()
