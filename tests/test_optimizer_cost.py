"""AdamW's step as the model prices it per `optimizer.implementation` (core/dryrun/adamw.py): its
temporaries against torch's own step, its time in the prediction, and the implementation each
public figure's software ran."""

from __future__ import annotations

import pytest
import torch
from torch.distributed._tools.mem_tracker import _TOTAL_KEY, MemTracker

from core.dryrun import adamw
from core.dryrun.runtime import predict
from core.dryrun.stack import config_settings
from core.optim import ADAM_KERNELS
from core.validate import validate
from recipes import registry
from recipes.report import perf_validation as V

SHAPES = ((1024, 256), (4096, 32), (512,))  # the largest tensor: 262,144 elements


def _step_peak_bytes(implementation: str) -> float:
    """Bytes above the step's start that torch's AdamW step holds at its peak (a second step:
    the moments exist)."""
    params = [torch.nn.Parameter(torch.randn(s)) for s in SHAPES]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1, **ADAM_KERNELS[implementation])
    opt.step()
    tracker = MemTracker()
    tracker.track_external(opt)
    with tracker:
        before = tracker.get_tracker_snapshot("current")
        opt.step()
    start = max(v[_TOTAL_KEY] for v in before.values()) if before else 0
    return max(v[_TOTAL_KEY] for v in tracker.get_tracker_snapshot("peak").values()) - start


@pytest.mark.parametrize("implementation", ["foreach", "fused"])
def test_the_step_temporaries_are_what_torch_allocates(implementation):
    n = sum(torch.Size(s).numel() for s in SHAPES)
    largest = max(torch.Size(s).numel() for s in SHAPES)
    counted = adamw.temporary_bytes(implementation, n, largest)
    measured = _step_peak_bytes(implementation)
    assert measured == pytest.approx(counted, abs=0.05 * 4 * n), (implementation, measured, counted)


def test_the_optimizer_time_follows_the_implementation():
    row = registry.get("llama3_8b/table1/8gpu_fsdp")
    times = {}
    for impl in ("fused", "foreach"):
        cfg = validate(registry.resolve_config(row, "dry-run", [f'optimizer.implementation="{impl}"']), 8)
        times[impl] = predict(cfg, "h100_96gb_hbm2e_500w")["breakdown"]["optimizer"]
    assert times["fused"] / times["foreach"] == pytest.approx(adamw.bytes_per_param("fused") / 96)
    assert adamw.bytes_per_param("foreach") == 96  # 84 for the step, 12 for clipping


def test_each_figure_runs_the_adamw_of_its_software():
    """torchtitan before PR 881 (2025-02-24) ran foreach unless the figure says otherwise (PR 355's
    pair names each); later software and this trainer run fused."""
    by_id = {f.id: f for f in V.figures()}
    impl = {fid: by_id[fid].cfg.optimizer.implementation for fid in by_id}
    assert impl["tt355/8b-8-a100-eager"] == "foreach"
    assert impl["tt355/8b-8-a100-eager-fused-adamw"] == "fused"
    assert impl["paper/llama3_8b/table1/8gpu_fsdp"] == "foreach"
    assert impl["tt1287/8b-8-eager"] == "fused"
    assert impl["ours-h200/8b-8blocks-bf16-ac-none"] == "fused"
    assert config_settings({"adamw_foreach": True}, ('optimizer.implementation="fused"',)) == [
        'optimizer.implementation="fused"'
    ]
