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


def test_a_cpu_peak_a_step_beats_is_measured_again(tmp_path, monkeypatch):
    """A cached CPU peak below what a step reached (measured while other ranks shared the cores)
    is dropped, so the next launch measures it again; a GPU's vendor peak is never touched."""
    from core import metrics

    monkeypatch.setenv("TITAN_CACHE", str(tmp_path))
    cache = tmp_path / "cpu_peak_flops.json"
    cfg = load_config(overrides=["metrics.log_freq=1", "metrics.progress=false"])

    def log_at(peak_is_cpu: bool, peak: float) -> None:
        cache.write_text(json.dumps({"bfloat16-threads1-2cpu": 1.0}))
        sl = metrics.StepLog(tmp_path / str(peak_is_cpu), 1, cfg, 100.0, 1.0, peak, 1, peak_is_cpu=peak_is_cpu)
        sl.log(1, 1.0, 1.0, 1e-4, dt=1.0, data_dt=0.0)  # 100 FLOP/s against the peak
        sl.close()

    log_at(peak_is_cpu=True, peak=1000.0)  # MFU 10%: kept
    assert cache.is_file()
    log_at(peak_is_cpu=False, peak=10.0)  # a GPU's figure over 100%: not this cache's business
    assert cache.is_file()
    log_at(peak_is_cpu=True, peak=10.0)  # MFU 1000%: the cached peak is dropped
    assert not cache.is_file()
