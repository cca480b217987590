"""Loss parity of every N-D layout against the single-process reference (recipes/studies/parity.py).

The multi-process cases share one torchrun per (world size, dtype) (`recipes.studies.parity.run_grouped`,
the real trainer run job after job) to keep start-up time down; each case still compares its
own per-step losses with the reference directly.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed.tensor.experimental._context_parallel._attention as cp_attention
from click.testing import CliRunner
from torch.distributed.tensor.parallel import ColwiseParallel

from core.config import ConfigError, load_config
from core.models.llama3 import create_model
from core.parallel.context import _cpu_flash_attention_rule
from core.parallel.parallelize import Toggles
from core.parallel.tensor import tp_styles
from core.validate import validate
from recipes.cli import main
from recipes.studies import parity as P
from recipes.studies import parity_layouts as PL
from recipes.studies import parity_tables as PT

pytestmark = pytest.mark.parity

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = ROOT / "results" / "golden"

# bf16: each kind of layout once at world <= 4 (FSDP mixed precision, autocast without FSDP, TP,
# CP, PP); `run-recipe parity --dtype bf16` runs the whole list (results/loss_parity.md).
BF16 = ["fsdp2", "hsdp2x2", "tp2", "fsdp2_tp2", "cp2_allgather", "fsdp2_cp2", "pp2_1f1b"]
CASES = [(layout.name, "fp32") for layout in PL.LAYOUTS] + [(name, "bf16") for name in BF16]
CASE_PARAMS = [pytest.param(n, d, id=f"{n}-{d}") for n, d in CASES]
# The sharded grad norm (FSDP x TP DTensors, summed over pp) against torch's plain one. AdamW is
# nearly invariant to clipping's uniform scale, so loss parity alone would not catch a wrong norm.
# fp32: torch's CPU fp32 norm of the 278k-element output-weight gradient is itself 9.6e-5 from
# the float64 value (the sharded norm, summing shorter pieces, 4.7e-5); measured layout vs
# reference <= 8.3e-5. A real bug is far larger: counting the replicated norm weights once per
# TP rank moves the norm by ~1% (their share of the squared norm is 2%).
GRAD_NORM_RTOL = {"fp32": 2e-4, "bf16": 1e-2}


@pytest.mark.slow
@pytest.mark.parametrize("name,dtype", CASE_PARAMS)
def test_layout_loss_parity(parity_runs, name, dtype):
    row = parity_runs.get(name, dtype)
    assert row["losses"], f"{name} ({dtype}) did not finish: {row.get('error')}"
    assert row["steps"] == PL.STEPS
    assert row["clipped_steps"] > 0, "clipping never acted: the sharded grad norm would go untested"
    assert row["tolerance"] == (PL.BY_NAME[name].tolerance or PL.TOLERANCE[dtype])
    assert row["max_abs_diff"] <= row["tolerance"], (
        f"{name}: {row['max_abs_diff']:.3e}\n layout    {row['losses']}\n reference {row['reference']}"
    )
    # layouts with their own loss tolerance (float8) get the low-precision grad-norm bound
    rtol = GRAD_NORM_RTOL["bf16" if PL.BY_NAME[name].tolerance else dtype]
    assert row["grad_norm_max_rel_diff"] <= rtol, row["grad_norm_max_rel_diff"]


# ------------------------------------------------------------------------------ golden losses
def _golden(dtype: str) -> dict:
    path = GOLDEN / f"loss_parity_{dtype}.json"
    assert path.is_file(), f"{path} missing: regenerate with `run-recipe parity --dtype {dtype}`"
    return json.loads(path.read_text())


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_reference_matches_golden(dtype):
    """The single-process reference of today against the stored golden per-step losses."""
    golden = _golden(dtype)
    tol = golden["golden_tolerance"]
    assert tol == PT.golden_tolerance(dtype) and golden["steps"] == PL.STEPS
    # the references the parity cases use (computed once per session, shared with them)
    layouts = {PT.reference_key(PL.BY_NAME[n], dtype): PL.BY_NAME[n] for n, d in reversed(CASES) if d == dtype}
    for key, layout in layouts.items():
        assert key in golden["reference"], f"no golden reference losses for {key}"
        stored = golden["reference"][key]
        ref = P.reference(layout, dtype)["losses"]
        diff = max(abs(a - b) for a, b in zip(ref, stored, strict=True))
        assert diff <= tol, f"reference {key} moved from golden by {diff:.3e} (tolerance {tol})"


@pytest.mark.slow
@pytest.mark.parametrize(
    "name,dtype", [("fsdp2_tp2", "fp32"), ("fsdp2_cp2", "fp32"), ("pp2_interleaved1f1b", "fp32"), ("fsdp2", "bf16")]
)
def test_layout_matches_golden(parity_runs, name, dtype):
    """A layout's losses today against its stored golden losses (shares the parity runs)."""
    golden = _golden(dtype)
    stored = golden["layouts"][name]["losses"]
    row = parity_runs.get(name, dtype)
    assert row["losses"], row.get("error")
    diff = max(abs(a - b) for a, b in zip(row["losses"], stored, strict=True))
    assert diff <= golden["golden_tolerance"], f"{name} moved from golden by {diff:.3e}"


# ------------------------------------------------------------------------- suite and bad input
def test_layout_list_covers_every_layout_kind():
    names = set(PL.BY_NAME)
    for required in [
        "fsdp2",
        "fsdp4",
        "fsdp8",
        "hsdp2x2",
        "tp2",
        "tp4",
        "fsdp2_tp2",
        "fsdp4_tp2",
        "cp2_allgather",
        "cp2_alltoall",
        "cp4_allgather",
        "cp4_alltoall",
        "fsdp2_cp2",
        "fsdp2_tp2_pp2",
        "fsdp2_tp2_pp2_cp2",
        # accumulation 2 (issue: PP divided earlier microsteps' gradients again): FSDP, TP, CP,
        # a single-stage schedule of each kind and a multi-stage one
        "fsdp2_accum2",
        "tp2_accum2",
        "cp2_accum2",
        "pp2_gpipe_accum2",
        "pp2_1f1b_accum2",
        "pp2_interleaved1f1b_accum2",
    ]:
        assert required in names
    for pp in (2, 4):
        for schedule in PL.PP_SCHEDULES:
            assert f"pp{pp}_{schedule.lower()}" in names
    for layout in PL.LAYOUTS:  # every layout is a valid config at its world size, global batch fixed
        cfg = load_config(None, layout.overrides("fp32"))
        validate(cfg, layout.world_size, check_files=False)
        assert cfg.training.local_batch_size * cfg.training.grad_accum_steps * layout.dp == PL.GLOBAL_BATCH
    assert PL.BY_NAME["fsdp2_tp2_pp2_cp2"].world_size == 16


@pytest.mark.parametrize(
    "overrides,key",
    [
        (["parallelism.tp=3", "parallelism.dp_shard=1"], "parallelism.tp"),  # tiny: 8 heads
        (["parallelism.tp=8", "parallelism.dp_shard=1"], "parallelism.tp"),  # tiny: 4 kv heads
        (["parallelism.cp=2", "training.seq_len=66", "parallelism.dp_shard=1"], "training.seq_len"),
        (["parallelism.cp=4", "training.seq_len=68", "parallelism.dp_shard=1"], "training.seq_len"),
        (
            ["parallelism.cp=2", "parallelism.tp=4", "training.seq_len=36", "parallelism.dp_shard=1"],
            "training.seq_len",
        ),  # 18 tokens per cp rank do not split over tp 4
    ],
)
def test_bad_tp_cp_config_refused_before_spawn(overrides, key):
    cfg = load_config(None, ["model.flavor=tiny", "data.dataset=synthetic", *overrides])
    with pytest.raises(ConfigError) as e:
        validate(cfg, check_files=False)
    assert str(e.value).startswith(key) and "\n" not in str(e.value)


def test_cli_refuses_bad_layout_name():
    result = CliRunner().invoke(main, ["parity", "--layouts", "fsdp2,fsdp3"])
    assert result.exit_code == 2 and "fsdp3" in result.output


def test_results_writer_merges_and_keeps_columns(tmp_path):
    row = {
        "layout": "fsdp2",
        "world_size": 2,
        "dtype": "fp32",
        "steps": 10,
        "max_abs_diff": 9.5e-7,
        "tolerance": 1e-5,
        "passed": True,
        "losses": [1.0] * 10,
        "reference": [1.0] * 10,
        "step_time_s": 0.1,
        "peak_memory_gib_per_rank": [0.3, 0.3],
        "memory_kind": "cpu peak RSS",
        "clipped_steps": 10,
        "grad_norm_max_rel_diff": 1e-7,
        "versions": {},
        "overrides": [],
    }
    PT.write_results([row], tmp_path)
    PT.write_results([dict(row, dtype="bf16", tolerance=1e-3)], tmp_path)
    PT.write_results([P.failed_row(PL.BY_NAME["tp2"], "fp32", "boom")], tmp_path)
    lines = (tmp_path / "loss_parity.csv").read_text().splitlines()
    assert lines[0] == "layout,world_size,dtype,steps,max_abs_diff,tolerance,passed"
    assert len(lines) == 4 and any(ln.startswith("tp2,2,fp32,0,nan") and ln.endswith("False") for ln in lines)
    assert "run failed" in (tmp_path / "loss_parity.md").read_text()
    golden = json.loads((tmp_path / "golden" / "loss_parity_fp32.json").read_text())
    assert golden["layouts"]["fsdp2"]["losses"] == [1.0] * 10 and "torch" in golden["versions"]


# ------------------------------------------------------------------------ TP styles, CP shim
def test_float8_tp_styles_need_converted_linears():
    cfg = load_config(None, ["float8.enabled=true", "float8.recipe=tensorwise"])
    model = create_model("tiny", device="meta")
    toggles = Toggles()
    assert tp_styles(model, cfg, toggles)[0] is ColwiseParallel
    assert "float8_tp" in toggles.skipped
    # torchao here only: its import prints kernel warnings every other test would show
    from torchao.float8 import convert_to_float8_training
    from torchao.float8.float8_tensor_parallel import Float8ColwiseParallel

    convert_to_float8_training(model, module_filter_fn=lambda m, fqn: fqn != "output")
    toggles = Toggles()
    if torch.cuda.is_available():
        assert tp_styles(model, cfg, toggles)[0] is Float8ColwiseParallel and "float8_tp" in toggles.applied
    else:  # gloo cannot all-gather float8 tensors: plain styles, and the record says why
        assert tp_styles(model, cfg, toggles)[0] is ColwiseParallel
        assert "gloo" in toggles.skipped["float8_tp"] and Float8ColwiseParallel is not ColwiseParallel
    cfg.float8.recipe = "rowwise"
    assert tp_styles(model, cfg, Toggles())[0] is ColwiseParallel


def test_cpu_cp_shim_is_scoped_to_the_context():
    op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    assert op not in cp_attention.custom_ops
    with _cpu_flash_attention_rule():
        assert op in cp_attention.custom_ops
        assert torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default in cp_attention.custom_ops
    assert op not in cp_attention.custom_ops
