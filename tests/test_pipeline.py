"""Pipeline parallelism: stage split, every torch schedule against the single-process run,
gradient scale, PP x FSDP2 (x TP), bf16 without FSDP, bubble fractions, bad input."""

from __future__ import annotations

import functools

import pytest
import torch

from core.config import ConfigError, load_config
from core.parallel.pipeline import library_schedules, stage_module
from core.parallel.schedule_sim import bubble_fraction
from core.parallel.stages import (
    PP_SCHEDULES,
    PP_SCHEDULES_SINGLE,
    V_SCHEDULES,
    pp_microbatches,
    split_layers,
    stage_ids_for_rank,
)
from core.validate import validate
from tests.dist_utils import GROUPS, TINY_JOB, max_abs_diff

pytestmark = [pytest.mark.parity]

BASE = [o for o in TINY_JOB if "flavor" not in o and "local_batch_size" not in o]  # global batch 8 x 64


def _job(flavor: str, dp: int = 1, *extra: str) -> list[str]:
    return [*BASE, f"--model.flavor={flavor}", f"--training.local_batch_size={8 // dp}", *extra]


def _pp(schedule: str, pp: int = 2, micro: int = 4) -> list[str]:
    return [f"--parallelism.pp={pp}", f"--parallelism.pp_schedule={schedule}", f"--parallelism.pp_microbatches={micro}"]


# ------------------------------------------------------------------------------- unit (fast)
def test_config_names_match_the_installed_torch():
    from torch.distributed.pipelining.schedules import PipelineScheduleSingle, get_schedule_class

    lib = library_schedules()
    assert set(lib) == set(PP_SCHEDULES), "core.parallel.stages.PP_SCHEDULES is out of sync with torch"
    for name, cls in lib.items():
        assert get_schedule_class(name) is cls
        assert issubclass(cls, PipelineScheduleSingle) == (name in PP_SCHEDULES_SINGLE)


def test_split_layers():
    assert split_layers(8, 4) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert split_layers(8, 3) == [[0, 1, 2], [3, 4, 5], [6, 7]]  # the remainder goes to the middle first
    assert [len(s) for s in split_layers(10, 4)] == [2, 3, 3, 2]
    assert [len(s) for s in split_layers(7, 2)] == [4, 3]
    # layers per stage: first and last stages give up the shortfall (they carry embedding / output)
    assert [len(s) for s in split_layers(10, 4, layers_per_stage=3)] == [2, 3, 3, 2]
    assert [len(s) for s in split_layers(9, 4, layers_per_stage=3)] == [2, 3, 3, 1]
    assert split_layers(8, 3, split_points=[1, 5]) == [[0], [1, 2, 3, 4], [5, 6, 7]]
    for bad in [
        {"n_stages": 9},
        {"n_stages": 4, "layers_per_stage": 1},
        {"n_stages": 4, "layers_per_stage": 5},
        {"n_stages": 3, "split_points": [3]},
        {"n_stages": 3, "split_points": [4, 4]},
        {"n_stages": 2, "split_points": [8]},
    ]:
        with pytest.raises(ConfigError, match="parallelism.pp"):
            split_layers(8, **bad)


def test_stage_placement_loop_and_v():
    assert [stage_ids_for_rank(r, 4, 8, "Interleaved1F1B") for r in range(4)] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    for name in ("ZBVZeroBubble", "DualPipeV"):
        assert [stage_ids_for_rank(r, 4, 8, name) for r in range(4)] == [[0, 7], [1, 6], [2, 5], [3, 4]]
    assert [stage_ids_for_rank(r, 2, 2, "1F1B") for r in range(2)] == [[0], [1]]


def test_stage_placement_matches_torch():
    """The torch-free placement (core.parallel.stages) is the library's own mapping."""
    from torch.distributed.pipelining._utils import generate_rank_to_stage_mapping

    for pp in (1, 2, 3, 4, 8):
        for spr in (1, 2, 3, 4):
            n = pp * spr
            for name in ("1F1B", "Interleaved1F1B", *V_SCHEDULES):
                style = "v" if name in V_SCHEDULES else "loop"
                lib = generate_rank_to_stage_mapping(pp, n, style=style)
                assert [stage_ids_for_rank(r, pp, n, name) for r in range(pp)] == [lib[r] for r in range(pp)]


def test_stage_modules_keep_fqns_and_partition_the_model():
    from core.models.llama3 import Transformer, get_args

    model = Transformer(get_args("tiny8", max_seq_len=64))
    names = {n for n, _ in model.named_parameters()}
    plan = split_layers(8, 3)
    parts = [stage_module(model, i, layers, 3) for i, layers in enumerate(plan)]
    seen = [{n for n, _ in p.named_parameters()} for p in parts]
    assert set().union(*seen) == names
    assert sum(len(s) for s in seen) == len(names)  # disjoint
    assert parts[0].tok_embeddings is not None and parts[0].output is None
    assert parts[1].tok_embeddings is None and parts[1].norm is None and list(parts[1].layers) == ["3", "4", "5"]
    assert parts[2].output is not None and parts[2].norm is not None


def test_bubble_fraction_matches_the_known_forms():
    for p in (2, 4, 8):
        for m in (p, 2 * p, 4 * p):
            ideal = (p - 1) / (m + p - 1)  # 1F1B / GPipe with B = 2 F
            assert bubble_fraction("1F1B", p, m) == pytest.approx(ideal, abs=1e-12)
            assert bubble_fraction("GPipe", p, m) == pytest.approx(ideal, abs=1e-12)
            inter = bubble_fraction("Interleaved1F1B", p, m, 2)
            assert inter == pytest.approx((p - 1) / (2 * m + p - 1), abs=1e-12)  # Megatron's v = 2
            assert bubble_fraction("LoopedBFS", p, m, 2) <= ideal
            for zb in ("InterleavedZeroBubble", "ZBVZeroBubble"):
                assert 0 <= bubble_fraction(zb, p, m, 2) < inter
    for name in PP_SCHEDULES:
        spr = 1 if name in PP_SCHEDULES_SINGLE else 2
        assert 0 <= bubble_fraction(name, 4, 8, spr) < 0.5
    # more stages per rank shrink the interleaved bubble further
    assert bubble_fraction("Interleaved1F1B", 4, 8, 4) < bubble_fraction("Interleaved1F1B", 4, 8, 2)


def _validate(*overrides: str, world: int):
    return validate(load_config(None, [o.lstrip("-") for o in overrides]), world, check_files=False)


def _tiny4_pp(*extra: str) -> list[str]:
    return ["model.flavor=tiny4", "data.dataset=synthetic", "training.local_batch_size=8", "parallelism.pp=2", *extra]


@pytest.mark.parametrize(
    "extra,world,key",
    [
        (["parallelism.pp_schedule=Zigzag"], 2, "parallelism.pp_schedule"),
        (_pp("1F1B", pp=4, micro=2), 4, "parallelism.pp_microbatches"),  # cannot fill 4 ranks
        (_pp("DualPipeV", micro=2), 2, "parallelism.pp_microbatches"),  # torch: >= one per stage (4)
        (
            _pp("InterleavedZeroBubble", pp=4, micro=9) + ["training.local_batch_size=9", "model.flavor=tiny8"],
            4,
            "parallelism.pp_microbatches",
        ),  # torch runs 9 // 4 = 2 rounds, which do not divide 9
        (_pp("1F1B", micro=3), 2, "parallelism.pp_microbatches"),  # does not divide the local batch 8
        (_pp("Interleaved1F1B", pp=4), 4, "parallelism.pp"),  # 8 stages > 4 layers
        (_pp("ZBVZeroBubble") + ["parallelism.pp_stages_per_rank=3"], 2, "parallelism.pp_stages_per_rank"),
        (_pp("1F1B") + ["parallelism.pp_stages_per_rank=2"], 2, "parallelism.pp_stages_per_rank"),
        (_pp("ZBVZeroBubble") + ["compile.enabled=true"], 2, "compile.enabled"),
        (_pp("1F1B") + ["parallelism.pp_layers_per_stage=1"], 2, "parallelism.pp_layers_per_stage"),
        (_pp("1F1B") + ["parallelism.pp_split_points=[1, 2]"], 2, "parallelism.pp_split_points"),
    ],
)
def test_bad_pipeline_config_is_refused_naming_the_key(extra, world, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")) as e:
        _validate(*_tiny4_pp(*extra), world=world)
    assert "\n" not in str(e.value)
    if key == "parallelism.pp_schedule":
        assert all(name in str(e.value) for name in PP_SCHEDULES)  # lists the valid names


@pytest.mark.parametrize(
    "extra,world",
    [
        (_pp("Interleaved1F1B", pp=4, micro=6) + ["training.local_batch_size=12", "model.flavor=tiny8"], 4),
        (_pp("Interleaved1F1B", pp=4, micro=10) + ["training.local_batch_size=10", "model.flavor=tiny8"], 4),
        (_pp("1F1B") + ["parallelism.pp_split_points=[3]"], 2),
        (_pp("1F1B") + ["parallelism.pp_layers_per_stage=2"], 2),
        (_pp("DualPipeV"), 2),
    ],
)
def test_valid_pipeline_configs_are_accepted(extra, world):
    _validate(*_tiny4_pp(*extra), world=world)


def test_default_microbatches_one_per_stage():
    cfg = _validate("model.flavor=tiny4", "parallelism.pp=2", "parallelism.pp_schedule=DualPipeV", world=2)
    assert pp_microbatches(cfg.parallelism, 4) == 4
    cfg = _validate("model.flavor=tiny4", "parallelism.pp=2", "parallelism.pp_schedule=1F1B", world=2)
    assert pp_microbatches(cfg.parallelism, 4) == 2


# ------------------------------------------------------------------------- multi-process (slow)
WORLD2 = {  # name -> overrides; one torchrun runs them all (start-up dominates tiny jobs)
    **{f"pp2_{s}": _job("tiny4", 1, *_pp(s)) for s in PP_SCHEDULES},
    "pp2_Interleaved1F1B_bf16": _job("tiny4", 1, *_pp("Interleaved1F1B"), "--training.mixed_precision_param=bfloat16"),
    "fsdp2_no_pp": _job("tiny4", 2, "--parallelism.dp_shard=2"),  # the non-pipelined gradients
}
WORLD4 = {
    "pp4_1F1B": _job("tiny4", 1, *_pp("1F1B", pp=4, micro=8)),
    "pp4_Interleaved1F1B": _job("tiny8", 1, *_pp("Interleaved1F1B", pp=4, micro=8)),
    "fsdp2_pp2_ZBVZeroBubble": _job("tiny4", 2, "--parallelism.dp_shard=2", *_pp("ZBVZeroBubble")),
}
WORLD8 = {
    "fsdp2_tp2_pp2_Interleaved1F1B": _job(
        "tiny4", 2, "--parallelism.dp_shard=2", "--parallelism.tp=2", *_pp("Interleaved1F1B")
    )
}


# One torchrun per world size for the jobs of every module (tests.dist_utils.GROUPS).
for _world, _jobs in ((2, WORLD2), (4, WORLD4), (8, WORLD8)):
    GROUPS.add(_world, {f"pp.{name}": overrides for name, overrides in _jobs.items()})


def _records(jobs: dict[str, list[str]], tmp_path_factory) -> dict[str, dict]:
    return {name: GROUPS.get(f"pp.{name}", tmp_path_factory) for name in jobs}


@functools.cache
def _reference(flavor: str, dtype: str = "float32") -> list[float]:
    """core.reference.reference_run on the global batch (8 sequences)."""
    from core.reference import reference_run

    cfg = validate(
        load_config(None, [o.lstrip("-") for o in _job(flavor)] + [f"training.mixed_precision_param={dtype}"]),
        1,
        check_files=False,
    )
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the CPU is shared with the other jobs; more threads only contend
    try:
        return reference_run(cfg)["losses"]
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def world2(tmp_path_factory):
    return _records(WORLD2, tmp_path_factory)


@pytest.fixture(scope="module")
def world4(tmp_path_factory):
    return _records(WORLD4, tmp_path_factory)


@pytest.fixture(scope="module")
def world8(tmp_path_factory):
    return _records(WORLD8, tmp_path_factory)


def _check_pp_record(rec: dict, schedule: str, pp: int, micro: int, flavor: str, no_pp: dict | None = None):
    ref = _reference(flavor)
    assert rec["steps"] == 10
    assert max_abs_diff(rec["losses"], ref) < 1e-5, (rec["losses"], ref)
    assert max(ref) - min(ref) > 0.1  # the losses differ step to step: matching them proves something
    assert f"pp:{schedule}" in rec["toggles_applied"]
    spr = 1 if schedule in PP_SCHEDULES_SINGLE else 2
    assert rec["pp_microbatches"] == micro and rec["pp_stages_per_rank"] == spr
    assert rec["pp_bubble_fraction"] == pytest.approx(bubble_fraction(schedule, pp, micro, spr))
    if no_pp is not None:
        # AdamW hides a constant gradient scale; the pre-clip grad norm does not: the pipelined
        # gradients must equal the non-pipelined run's (scale_grads over the microbatches).
        # 1e-3: torch's fp32 CPU norm kernel alone differs by ~5e-5 between a sharded and a
        # whole output-projection gradient; a wrong scale would be off by >= 2x.
        base = no_pp["grad_norms"]
        assert max(abs(a - b) / b for a, b in zip(rec["grad_norms"], base, strict=True)) < 1e-3, (
            rec["grad_norms"],
            base,
        )


@pytest.mark.slow
@pytest.mark.parametrize("schedule", PP_SCHEDULES)
def test_pp2_schedule_matches_single_process(schedule, world2):
    _check_pp_record(world2[f"pp2_{schedule}"], schedule, 2, 4, "tiny4", world2["fsdp2_no_pp"])


@pytest.mark.slow
def test_pp_bf16_without_fsdp_runs_under_autocast(world2):
    rec = world2["pp2_Interleaved1F1B_bf16"]
    assert "pp_autocast_bf16" in rec["toggles_applied"]
    bf16, fp32 = _reference("tiny4", "bfloat16"), _reference("tiny4")
    assert max_abs_diff(rec["losses"], bf16) < 1e-3
    # step 1 (same weights): bf16 autocast rounding is visible against fp32, not against bf16
    assert abs(rec["losses"][0] - bf16[0]) < 1e-5
    assert abs(rec["losses"][0] - fp32[0]) > 10 * abs(rec["losses"][0] - bf16[0])


@pytest.mark.slow
@pytest.mark.parametrize(
    "name,schedule,flavor", [("pp4_1F1B", "1F1B", "tiny4"), ("pp4_Interleaved1F1B", "Interleaved1F1B", "tiny8")]
)
def test_pp4_matches_single_process(name, schedule, flavor, world4, world2):
    _check_pp_record(world4[name], schedule, 4, 8, flavor, world2["fsdp2_no_pp"] if flavor == "tiny4" else None)


@pytest.mark.slow
def test_fsdp2_pp2_zero_bubble_matches_single_process(world4, world2):
    rec = world4["fsdp2_pp2_ZBVZeroBubble"]
    _check_pp_record(rec, "ZBVZeroBubble", 2, 4, "tiny4", world2["fsdp2_no_pp"])
    assert "fsdp" in rec["toggles_applied"]


@pytest.mark.slow
def test_fsdp2_tp2_pp2_matches_single_process(world8, world2):
    rec = world8["fsdp2_tp2_pp2_Interleaved1F1B"]
    _check_pp_record(rec, "Interleaved1F1B", 2, 4, "tiny4", world2["fsdp2_no_pp"])
    assert {"fsdp", "tp", "loss_parallel"} <= set(rec["toggles_applied"])


def test_the_last_stage_keeps_no_microbatch_logits_and_grads_need_no_rescale(monkeypatch):
    """The step asks the schedule for no outputs (at 405B every microbatch's logits, ~16 GiB, on
    the fullest rank), and a schedule is built without scale_grads, which torch 2.13 applies after
    every step(): under accumulation it divided the earlier microsteps' gradients again."""
    import contextlib
    import inspect
    import types

    from core.parallel import pipeline
    from core.step import TrainStep

    seen = {}

    class Schedule:
        def step(self, *args, target=None, losses=None, **kwargs):
            seen.update(kwargs)
            losses.append(torch.tensor(1.0))

    stage = types.SimpleNamespace(is_first=True, is_last=True)
    step = types.SimpleNamespace(pp_schedule=Schedule(), stages=[stage], device=torch.device("cpu"), cfg=None)
    monkeypatch.setattr("core.step.loss_parallel_context", lambda cfg: contextlib.nullcontext())
    TrainStep._pipeline_step(step, torch.zeros(1, 4, dtype=torch.long), torch.zeros(1, 4, dtype=torch.long))
    assert seen.get("return_outputs") is False
    source = inspect.getsource(pipeline.build_pipeline)
    assert "scale_grads=False" in source and "scale_grads=True" not in source
