"""The profiler window (`[profiling]`, core/step_hooks.py): per-rank Chrome traces and op tables,
the ranks' top ops in the record, the losses untouched, bad windows refused before launch."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from core.config import ConfigError, load_config
from core.train import Trainer
from core.validate import validate
from tests.dist_utils import GROUPS, TINY_JOB

pytestmark = pytest.mark.core

WINDOW = ["--profiling.enabled=true", "--profiling.start_step=3", "--profiling.steps=2"]
FSDP2 = [o for o in TINY_JOB if "local_batch_size" not in o] + ["--training.local_batch_size=4"]
GROUPS.add(2, {"fsdp.fsdp2": FSDP2 + ["--parallelism.dp_shard=2"]})  # test_fsdp's job: the same one
GROUPS.add(2, {"profiling.fsdp2": FSDP2 + ["--parallelism.dp_shard=2", *WINDOW]})


def _ops(folder: Path, rank: int) -> dict[str, dict]:
    with open(folder / f"rank{rank}_ops.csv") as f:
        return {row["op"]: row for row in csv.DictReader(f)}


def _check_rank_files(folder: Path, rank: int) -> dict[str, dict]:
    trace = json.loads((folder / f"rank{rank}_trace.json").read_text())
    spans = {e["name"] for e in trace["traceEvents"] if e.get("ph") == "X"}
    assert {"step 3", "step 4"} <= spans and "step 2" not in spans and "step 5" not in spans
    assert "aten::mm" in (folder / f"rank{rank}_ops.txt").read_text()
    return _ops(folder, rank)


def test_profile_window_writes_trace_and_op_table(pg, tmp_path):
    overrides = [o.lstrip("-") for o in TINY_JOB + WINDOW] + ["training.steps=4", f"job.output_dir={tmp_path}"]
    cfg = validate(load_config(None, overrides), 1, check_files=False)
    rec = Trainer(cfg).train()
    prof = rec["profile"]
    assert prof["steps"] == [3, 4] and len(prof["ranks"]) == 1
    ops = _check_rank_files(Path(prof["folder"]), 0)
    # counts and times are per profiled step, and the table's self times add up to the record's
    mm = ops["aten::mm"]
    assert float(mm["calls_per_step"]) >= 2 * 2 * 7  # forward + backward of 7 linears at least
    r0 = prof["ranks"][0]
    total = sum(float(r["self_ms_per_step"]) for r in ops.values())
    assert total / 1e3 == pytest.approx(r0["self_s_per_step"], rel=1e-6)
    shares = [t["share"] for t in r0["top_ops"]]
    assert shares == sorted(shares, reverse=True) and 0 < sum(shares) <= 1 + 1e-9
    assert r0["self_s_per_step"] <= 1.5 * r0["wall_s_per_step"]  # one thread's time, bounded by the wall


def test_profiling_off_leaves_no_trace(pg, tmp_path):
    cfg = validate(
        load_config(None, [o.lstrip("-") for o in TINY_JOB] + ["training.steps=3", f"job.output_dir={tmp_path}"]),
        1,
        check_files=False,
    )
    rec = Trainer(cfg).train()
    assert "profile" not in rec and not (tmp_path / "profile").exists()


@pytest.mark.parametrize(
    "overrides,match",
    [
        (["profiling.start_step=9", "profiling.steps=3"], r"start_step: steps 9..11 run past training.steps=10"),
        (["profiling.steps=0"], "profiling: start_step and steps must be >= 1"),
        (["profiling.folder='checkpoint'"], "profiling.folder"),
        (["profiling.folder='/tmp'"], "profiling.folder"),
    ],
)
def test_bad_profile_window_is_refused(overrides, match):
    with pytest.raises(ConfigError, match=match):
        validate(load_config(None, [o.lstrip("-") for o in TINY_JOB] + ["profiling.enabled=true", *overrides]), 1)


@pytest.mark.slow
def test_every_rank_profiles_and_the_losses_do_not_move(tmp_path_factory):
    rec = GROUPS.get("profiling.fsdp2", tmp_path_factory)
    plain = GROUPS.get("fsdp.fsdp2", tmp_path_factory)
    assert rec["losses"] == plain["losses"]  # the profiler only observes
    prof = rec["profile"]
    assert [r["rank"] for r in prof["ranks"]] == [0, 1]
    for rank in (0, 1):
        ops = _check_rank_files(Path(prof["folder"]), rank)
        assert any(op.startswith("FSDP::") for op in ops), sorted(ops)[:20]  # FSDP2's collectives are in it
