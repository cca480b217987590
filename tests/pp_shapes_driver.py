"""Compare the example shapes of `parallelism.pp_static_shapes` with what torch infers (for
tests/test_pp_static.py). For each job, in one torchrun group:

1. a Trainer with dynamic inference runs one step; every stage's inferred metadata (inputs,
   outputs and their gradients) is compared with the examples `stage_examples` computes;
2. a Trainer with static shapes runs one step under TORCH_DISTRIBUTED_DEBUG=DETAIL, where torch
   checks every microbatch's tensors (activations and gradients, sent and received) against them.

    python -m recipes.forked_run --standalone --nproc_per_node=W -m tests.pp_shapes_driver PLAN.json
    PLAN.json: {"root": dir, "jobs": [{"name": str, "overrides": [...]}, ...]}
    -> <root>/<name>/rank_<R>.json: {"stages": {stage id: [differences]}, "dynamic_loss", "static_loss"}
"""

import json
import os
import sys
from pathlib import Path


def _metas(values):
    # private: torch's own metadata of a tensor tuple, what PipelineStage records and compares
    from torch.distributed.pipelining._utils import extract_tensor_metas

    return None if values is None else extract_tensor_metas(tuple(values), allow_none=True)


def stage_differences(trainer) -> dict[str, list[str]]:
    """Stage id -> what differs between the stage's inferred metadata and the examples."""
    from core.parallel.pipeline import activation_dtype, stage_examples
    from core.parallel.stages import static_stage_shapes

    cfg, args = trainer.cfg, trainer.model_args
    shapes = static_stage_shapes(cfg, args.n_layers, args.dim, args.vocab_size)
    out = {}
    for stage in trainer.model.stages:
        n = stage.num_stages
        mesh = trainer.mesh["tp"] if shapes.vocab_shards > 1 else None
        want = stage_examples(stage.stage_index, n, shapes, activation_dtype(cfg, trainer.dims), mesh)
        got = stage._stage_meta  # private: the metadata the stage inferred (no public reader)
        diffs = []
        for field in ("inputs", "outputs", "input_grads", "output_grads"):
            key = {"inputs": "input_args", "outputs": "output_args"}.get(field, field)
            if field == "output_grads" and stage.is_last:  # the loss starts backward: none inferred
                continue
            mine, theirs = _metas(want[key]), getattr(got, field)
            if mine != theirs:  # dataclass equality: shape, stride, dtype, requires_grad (+ DTensor layout)
                diffs.append(f"{field}: examples {mine} != inferred {theirs}")
        out[str(stage.stage_index)] = diffs
    return out


def _one_step(cfg) -> tuple:
    """(the Trainer, the loss of its first step)."""
    from core.train import Trainer

    trainer = Trainer(cfg)
    batch = next(iter(trainer.dataloader))
    return trainer, trainer.train_step([batch]).loss


def before_fork(argv: list[str]) -> None:
    """recipes/forked_run.py calls it before forking the ranks: the trainer, imported once."""
    import core.train  # noqa: F401


def main() -> None:
    import torch.distributed as dist

    from core.config import load_config
    from core.train import init_distributed
    from core.validate import validate

    plan = json.loads(Path(sys.argv[1]).read_text())
    world = int(os.environ.get("WORLD_SIZE", "1"))
    cfgs = {}
    for job in plan["jobs"]:
        out = Path(plan["root"]) / job["name"]
        base = [*job["overrides"], f"--job.output_dir={out}"]
        cfgs[job["name"]] = [
            validate(load_config(None, [*base, f"--parallelism.pp_static_shapes={s}"]), world, check_files=False)
            for s in ("false", "true")
        ]
    init_distributed(next(iter(cfgs.values()))[0])
    for name, (dynamic, static) in cfgs.items():
        trainer, dynamic_loss = _one_step(dynamic)
        report = {"stages": stage_differences(trainer), "dynamic_loss": dynamic_loss}
        del trainer
        dist.set_debug_level(dist.DebugLevel.DETAIL)  # stages built now check every microbatch
        try:
            report["static_loss"] = _one_step(static)[1]
        finally:
            dist.set_debug_level(dist.DebugLevel.OFF)
        out = Path(plan["root"]) / name
        out.mkdir(parents=True, exist_ok=True)
        (out / f"rank_{dist.get_rank()}.json").write_text(json.dumps(report))
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
