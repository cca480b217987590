"""metrics.jsonl: each step's line holds what that step used (its learning rate), in process."""

from __future__ import annotations

import json

import pytest

from core.config import load_config
from core.optim import lr_factor
from core.train import Trainer
from core.validate import validate
from tests.dist_utils import TINY_JOB

pytestmark = pytest.mark.core


def test_metrics_lr_is_the_lr_the_step_used(pg, tmp_path):
    steps, warmup, lr = 5, 2, 1e-3
    overrides = [o.lstrip("-") for o in TINY_JOB] + [
        f"training.steps={steps}",
        f"lr_scheduler.warmup_steps={warmup}",
        f"optimizer.lr={lr}",
        "metrics.log_freq=1",
        f"job.output_dir={tmp_path}",
    ]
    trainer = Trainer(validate(load_config(None, overrides), 1, check_files=False))
    used = []  # the lr each optimizer step applied, read as it starts
    trainer.optimizer.register_step_pre_hook(lambda opt, *_: used.append(opt.param_groups[0]["lr"]))
    trainer.train()
    logged = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    logged = [row["lr"] for row in logged if "lr" in row]
    assert len(used) == steps and logged == pytest.approx(used)
    cfg = trainer.cfg.lr_scheduler
    assert logged[0] == pytest.approx(lr * lr_factor(0, warmup, steps, cfg.decay_type, cfg.min_lr_factor))
