"""The dry-run performance model (core/dryrun/runtime.py): physics, GPU specs, speed, the FLOP
count against torch's counter, and the goals against the paper's throughput tables."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import time

import pytest

from core.dryrun import gpuspec as G
from core.dryrun.runtime import predict
from recipes import registry

pytestmark = pytest.mark.perfmodel

PAPER = G.DEFAULT_GPU
NO_MEM = {"allocated_peak_gib": 0.0}  # memory is not under test here: skip the accounting


@functools.cache
def cfg_of(rid: str):
    return registry.resolve_config(registry.get(rid), "dry-run")


def tps(rid: str, spec=PAPER) -> float:
    return predict(cfg_of(rid), spec, memory=NO_MEM)["tokens_per_sec_per_gpu"]


def spec(**changes) -> G.GPUSpec:
    return dataclasses.replace(G.load_spec(PAPER), **changes)


ROWS = [r.id for r in registry.all_recipes()]


# ------------------------------------------------------------------------------------- physics
def test_more_bandwidth_never_slows_a_row():
    base = G.load_spec(PAPER)
    for factor in (2.0, 10.0):
        faster = dataclasses.replace(
            base,
            hbm_bandwidth=base.hbm_bandwidth * factor,
            nvlink_bandwidth=base.nvlink_bandwidth * factor,
            network_bandwidth=base.network_bandwidth * factor,
        )
        for rid in ROWS:
            assert tps(rid, faster) >= tps(rid, base) * (1 - 1e-9), (rid, factor)
    # each link alone too
    for field in ("hbm_bandwidth", "nvlink_bandwidth", "network_bandwidth"):
        faster = dataclasses.replace(base, **{field: getattr(base, field) * 4})
        for rid in ROWS:
            assert tps(rid, faster) >= tps(rid, base) * (1 - 1e-9), (rid, field)


def fp8_as_bf16(base: G.GPUSpec) -> G.GPUSpec:
    """The spec with its FP8 peak and every FP8 GEMM table equal to BF16's."""
    bf16 = base.gemm_points("bf16")
    gemm = tuple((kind, bf16) for kind, _ in base.gemm)
    return dataclasses.replace(base, peak_fp8_flops=base.peak_bf16_flops, gemm=gemm)


@functools.cache
def cfg_with(rid: str, *overrides: str):
    return registry.resolve_config(registry.get(rid), "dry-run", list(overrides))


def test_fp8_peak_equal_to_bf16_removes_float8_compute_gain():
    same = fp8_as_bf16(G.load_spec(PAPER))
    # Full AC: both recompute the same forward (test_float8_recomputes_the_same_matmuls_as_bf16
    # checks selective op AC).
    full = "activation_checkpoint.mode=full"
    for gpus in (8, 128):
        f8 = predict(cfg_with(f"llama3_8b/table1/{gpus}gpu_fsdp_compile_float8", full), same, memory=NO_MEM)
        bf = predict(cfg_with(f"llama3_8b/table1/{gpus}gpu_fsdp_compile", full), same, memory=NO_MEM)
        assert f8["breakdown"]["compute"] == pytest.approx(bf["breakdown"]["compute"], rel=1e-9)
        assert f8["tokens_per_sec_per_gpu"] <= bf["tokens_per_sec_per_gpu"]  # only the casts remain
        # with the real FP8 rate Float8 is faster
        assert tps(f"llama3_8b/table1/{gpus}gpu_fsdp_compile_float8") > tps(f"llama3_8b/table1/{gpus}gpu_fsdp_compile")


def test_float8_recomputes_the_same_matmuls_as_bf16():
    """Selective op AC saving every other matmul recomputes wk, wo and w3 under Float8 too: the
    policy sees each float8 matmul as aten.mm on torchao's subclass, counted like a bf16 one. With
    FP8 rates equal to BF16's, Float8's recompute is bf16's plus its casts, never less."""
    same = fp8_as_bf16(G.load_spec(PAPER))
    f8 = predict(cfg_with("llama3_8b/table1/8gpu_fsdp_compile_float8"), same, memory=NO_MEM)
    bf = predict(cfg_with("llama3_8b/table1/8gpu_fsdp_compile"), same, memory=NO_MEM)
    assert cfg_with("llama3_8b/table1/8gpu_fsdp_compile_float8").activation_checkpoint.save_every_other_mm
    assert f8["breakdown"]["compute"] == pytest.approx(bf["breakdown"]["compute"], rel=1e-9)
    assert f8["breakdown"]["recompute"] > bf["breakdown"]["recompute"]


def test_one_gpu_per_node_makes_tp_slower():
    one = spec(gpus_per_node=1)
    for rid in ("llama3_70b/table2/256gpu_fsdp_tp_compile_float8", "llama3_405b/table3/512gpu_3d_1f1b"):
        slow = predict(cfg_of(rid), one, memory=NO_MEM)
        fast = predict(cfg_of(rid), PAPER, memory=NO_MEM)
        assert slow["tokens_per_sec_per_gpu"] < fast["tokens_per_sec_per_gpu"]
        assert slow["breakdown"]["exposed_comm"]["tp"] > fast["breakdown"]["exposed_comm"]["tp"]
        assert slow["links"]["tp"]["across_nodes"] and not fast["links"]["tp"]["across_nodes"]


def test_free_communication_leaves_compute_memory_and_bubbles():
    free = spec(
        nvlink_bandwidth=math.inf,
        network_bandwidth=math.inf,
        nvlink_latency_s=0.0,
        network_latency_s=0.0,
        collective_base_latency_s=0.0,
    )
    for rid in ROWS:
        p = predict(cfg_of(rid), free, memory=NO_MEM)
        b = p["breakdown"]
        assert sum(b["exposed_comm"].values()) == pytest.approx(0.0, abs=1e-12), rid
        parts = b["compute"] + b["memory_bound"] + b["recompute"] + b["bubble"] + b["optimizer"]
        assert p["step_time_s"] == pytest.approx(parts, rel=1e-9), rid
        assert p["tokens_per_sec_per_gpu"] >= tps(rid) * (1 - 1e-9)


def test_interleaving_shrinks_the_bubble_not_the_work():
    a = predict(cfg_of("llama3_405b/table3/512gpu_3d_1f1b"), PAPER, memory=NO_MEM)["breakdown"]
    b = predict(cfg_of("llama3_405b/table3/512gpu_3d_interleaved_1f1b"), PAPER, memory=NO_MEM)["breakdown"]
    assert b["compute"] == pytest.approx(a["compute"], rel=1e-9)
    assert b["bubble"] < 0.7 * a["bubble"]


def test_breakdown_adds_up_to_the_step():
    for rid in ROWS:
        p = predict(cfg_of(rid), PAPER, memory=NO_MEM)
        b = p["breakdown"]
        total = (
            b["compute"]
            + b["memory_bound"]
            + b["recompute"]
            + b["bubble"]
            + b["optimizer"]
            + sum(b["exposed_comm"].values())
        )
        assert p["step_time_s"] == pytest.approx(total, rel=1e-6), rid
        assert all(v >= 0 for k, v in b.items() if k != "exposed_comm")


# ------------------------------------------------------------------------- ring attention (CP)
def _link(bw: float, lat: float = 0.0, size: int = 8):
    from core.dryrun.comms import Link

    return Link("cp", size, False, bw, lat, lat)


def test_ring_terms_are_zero_without_cp():
    from core.dryrun import ring

    assert ring.glue_bytes(1) == (0.0, 0.0)
    assert ring.exposed_comm(1e9, 1, "allgather", _link(1e9, 1e-5, 1), 0.0, 0.0) == (0.0, 0.0)
    for rid in ("long_context/table4/8b_fsdp8_cp1_32k", "long_context/table5/405b_fsdp8_cp1_32k"):
        assert "cp" not in predict(cfg_of(rid), PAPER, memory=NO_MEM)["breakdown"]["exposed_comm"]


def test_ring_overhead_grows_with_the_cp_degree():
    from core.dryrun import ring

    glue = [ring.glue_bytes(c) for c in (2, 4, 8, 16)]
    assert all(a[0] < b[0] and a[1] < b[1] for a, b in itertools.pairwise(glue))
    # 32K tokens per CP rank: the SDPA per step stays the same, the k/v all-gather grows with cp
    for method in ("allgather", "alltoall"):
        exp = [
            sum(ring.exposed_comm(32768 * 2048, c, method, _link(25e9, 6.6e-6), 0.05 * c, 0.1 * c)) for c in (2, 4, 8)
        ]
        assert all(a <= b for a, b in itertools.pairwise(exp)), (method, exp)
    t5 = [f"long_context/table5/405b_fsdp{8 // c}_cp{c}_{32 * c}k" for c in (2, 4, 8)]
    cp = [predict(cfg_of(rid), PAPER, memory=NO_MEM)["breakdown"]["exposed_comm"]["cp"] for rid in t5]
    assert cp[0] < cp[1] < cp[2]
    t4 = [f"long_context/table4/8b_fsdp{8 // c}_cp{c}_{32 * c}k" for c in (1, 2, 4, 8)]
    mb = [predict(cfg_of(rid), PAPER, memory=NO_MEM)["breakdown"]["memory_bound"] for rid in t4]
    assert all(a < b for a, b in itertools.pairwise(mb))


def test_ring_passes_query_wide_kv_and_hides_all_but_the_last_dkv_hop():
    """k and v reach SDPA after repeat_kv: the all-gather moves cp x (k + v) as wide as q in bf16,
    the dk/dv hops fp32 of the same width; with no SDPA to hide behind all of it shows, with
    unlimited SDPA time only the backward's last dk/dv hop does."""
    from core.dryrun import ring

    n, bw, cp = 1e8, 100e9, 4
    f, b = ring.exposed_comm(n, cp, "allgather", _link(bw, size=cp), 0.0, 0.0)
    ag = (cp - 1) / cp * (cp * 4 * n) / bw
    assert f == pytest.approx(ag) and b == pytest.approx(ag + cp * 8 * n / bw)
    for method in ("allgather", "alltoall"):
        f, b = ring.exposed_comm(n, cp, method, _link(bw, size=cp), 1e9, 1e9)
        assert f == 0.0 and b == pytest.approx(8 * n / bw)
        free = ring.exposed_comm(n, cp, method, _link(math.inf, size=cp), 0.0, 0.0)
        assert free == (0.0, 0.0)


# ------------------------------------------------------------------------------------ GPU specs
def test_every_spec_loads_and_unknown_names_are_listed():
    known = G.known_gpus()
    assert {"h100_96gb_hbm2e_500w", "h100_sxm_80gb", "h200_141gb", "b200", "a100_sxm_80gb", "gb200"} <= set(known)
    for name in known:
        assert G.load_spec(name).name == name
    with pytest.raises(G.SpecError) as e:
        G.load_spec("a100_nope")
    assert all(n in str(e.value) for n in known)


def _paper_toml() -> dict:
    from importlib import resources

    import tomllib

    return tomllib.loads((resources.files("core.dryrun") / "hardware" / f"{PAPER}.toml").read_text())


@pytest.mark.parametrize(
    "section,field,value",
    [
        ("links", "gpus_per_node", None),
        ("compute", "peak_bf16_flops", 0),
        ("memory", "hbm_bandwidth", -1.0),
        ("efficiency", "nccl_rdma", 1.5),
        ("links", "network_latency_s", "fast"),
    ],
)
def test_bad_spec_is_refused_naming_the_field(section, field, value):
    data = _paper_toml()
    if value is None:
        del data[section][field]
    else:
        data[section][field] = value
    with pytest.raises(G.SpecError, match=f"{section}.{field}"):
        G.parse_spec(data, "bad.toml")


def test_float8_is_refused_on_a_gpu_without_fp8_tensor_cores():
    """The A100 (compute capability 8.0) has no FP8 tensor cores: its spec has no FP8 peak, so a
    Float8 config is refused with the reason, while bf16 is predicted; a float8 GEMM table
    without an FP8 peak is refused when the spec loads."""
    from core.dryrun.linears import NoFloat8

    a100 = G.load_spec("a100_sxm_80gb")
    assert a100.peak_fp8_flops == 0.0 and a100.compute_capability == "8.0"
    cfg = cfg_of("llama3_8b/table1/8gpu_fsdp_compile_float8")
    with pytest.raises(NoFloat8, match=r"a100_sxm_80gb \(compute capability 8.0\) has no FP8 tensor cores"):
        predict(cfg, "a100_sxm_80gb", memory=NO_MEM)
    assert (
        predict(cfg_of("llama3_8b/table1/8gpu_fsdp_compile"), "a100_sxm_80gb", memory=NO_MEM)["tokens_per_sec_per_gpu"]
        > 0
    )
    assert predict(cfg, "gb200", memory=NO_MEM)["tokens_per_sec_per_gpu"] > 0  # Blackwell: FP8 priced
    data = _paper_toml()
    del data["compute"]["peak_fp8_flops"]
    with pytest.raises(G.SpecError, match="gemm.fp8_tensorwise needs compute.peak_fp8_flops"):
        G.parse_spec(data, "bad.toml")
    data = _paper_toml()
    data["compute"]["compute_capability"] = 9
    with pytest.raises(G.SpecError, match="compute.compute_capability"):
        G.parse_spec(data, "bad.toml")


def test_run_refuses_unknown_gpu_before_running(tmp_path):
    from click.testing import CliRunner

    from recipes.cli import main

    res = CliRunner().invoke(
        main, ["run", "llama3_8b/table1/8gpu_fsdp", "--mode", "dry-run", "--gpu", "b300", "--out", str(tmp_path / "x")]
    )
    assert res.exit_code != 0
    assert "h100_sxm_80gb" in res.output and not (tmp_path / "x").exists()


def test_dry_run_record_has_the_prediction():
    from core.dryrun.record import dry_run

    rec = dry_run(cfg_of("llama3_8b/table1/8gpu_fsdp"), fake=False, gpu="h200_141gb")
    p = rec["predicted"]
    assert p["gpu"] == "h200_141gb" and p["tokens_per_sec_per_gpu"] > 0 and p["step_time_s"] > 0
    assert set(p["breakdown"]) >= {"compute", "memory_bound", "recompute", "bubble", "optimizer", "exposed_comm"}
    # faster HBM than the paper's 500 W part: faster
    assert p["tokens_per_sec_per_gpu"] > tps("llama3_8b/table1/8gpu_fsdp")


# ----------------------------------------------------------------------------------------- speed
def test_all_rows_predicted_fast():
    t0 = time.perf_counter()
    for rid in ROWS:
        predict(cfg_of(rid), PAPER)  # with the memory accounting, as the record does
    assert time.perf_counter() - t0 < 120


def test_plan_ranks_100_candidates_by_speed_fast():
    from recipes.plan.layouts import candidates

    t0 = time.perf_counter()
    n = 0
    for model, gpus, seq, lb in (("405B", 512, 8192, 32), ("70B", 256, 8192, 16), ("8B", 64, 8192, 2)):
        ranked = candidates(model, gpus, seq, 95.0, lb, by_speed=True)
        n += len(ranked)
        fitting = [c for c in ranked if c.fits and not c.violations]
        assert all(a.tps >= b.tps * (1 - 0.03) for a, b in itertools.pairwise(fitting))
    took = time.perf_counter() - t0
    print(f"\nplan: {n} candidates ranked by speed in {took:.1f} s")
    assert n >= 100 and took < 30


def test_plan_json(tmp_path):
    import json

    from click.testing import CliRunner

    from recipes.cli import main

    res = CliRunner().invoke(
        main,
        ["plan", "--model", "70B", "--gpus", "64", "--global-batch", "64", "--gpu", "h100_sxm_80gb", "--json"],
        catch_exceptions=False,
    )
    assert res.exit_code == 0, res.output
    ranked = json.loads(res.output)
    assert ranked and all(r["gpu"] == "h100_sxm_80gb" for r in ranked)
    fit = [r for r in ranked if r["fits"] and not r["violations"]]
    fastest = max(fit, key=lambda r: r["tokens_per_sec_per_gpu"])
    band = max(0.03, fastest["error_band_pct"] / 100, fit[0]["error_band_pct"] / 100)  # a tie within the band
    assert fit[0]["tokens_per_sec_per_gpu"] >= (1 - band) * fastest["tokens_per_sec_per_gpu"]


# ------------------------------------------------------------------------------ FLOP count check
def test_flop_counter_agrees_with_the_analytic_count():
    """torch's FlopCounterMode around the fake step (a small FSDP layout on a fake process group)
    counts the same matmul and attention FLOPs as the model. On CPU SDPA runs as
    `_scaled_dot_product_flash_attention_for_cpu`, which the counter has no formula for: we give
    it torch's own SDPA formulas (forward and backward), nothing of ours."""
    import torch
    from torch.utils.flop_counter import (
        FlopCounterMode,
        register_flop_formula,
        sdpa_backward_flop_count,
        sdpa_flop_count,
    )

    from core.config import load_config
    from core.dryrun import fake_step as F
    from core.dryrun.runtime import analytic_flops
    from core.validate import validate

    aten = torch.ops.aten
    fwd_op = aten._scaled_dot_product_flash_attention_for_cpu
    bwd_op = aten._scaled_dot_product_flash_attention_for_cpu_backward
    from torch.utils.flop_counter import flop_registry

    if fwd_op not in flop_registry:
        register_flop_formula(fwd_op, get_raw=True)(
            lambda q, k, v, *a, **kw: sdpa_flop_count(q.shape, k.shape, v.shape)
        )
        register_flop_formula(bwd_op, get_raw=True)(
            lambda go, q, k, v, *a, **kw: sdpa_backward_flop_count(go.shape, q.shape, k.shape, v.shape)
        )
    base = [
        'model.flavor="tiny4"',
        "training.seq_len=512",
        "training.local_batch_size=2",
        'training.mixed_precision_param="bfloat16"',
        'training.mixed_precision_reduce="float32"',
        'data.dataset="synthetic"',
        'job.mode="dry-run"',
        "parallelism.dp_shard=2",
    ]
    cfg = validate(load_config(overrides=base), world_size=2, check_files=False)
    with FlopCounterMode(display=False) as fc:
        F.fake_step(cfg, track=False, isolate=False)
    counts = {str(k): v for k, v in fc.get_flop_counts()["Global"].items()}
    ours = analytic_flops(cfg)
    assert counts["aten.mm"] == ours["matmul"]
    attn = sum(v for k, v in counts.items() if "scaled_dot_product" in k)
    assert attn == ours["attention"] and fc.get_total_flops() == ours["total"]


# ----------------------------------------------------------------------------------------- goals
PCT_GOAL, ROWS_GOAL = 15.0, 15


@functools.cache
def as_the_paper_ran_it() -> dict[str, float]:
    """Each paper row's prediction for the software that ran it (torchtitan of 2024-09: flash
    attention, foreach AdamW, ...; recipes/report/perf_validation.py's `paper/` figures), not
    this trainer's: the paper's figures are judged like for like."""
    from core.dryrun.stack import stack_of
    from recipes.report import perf_validation as V

    paper = [f for f in V.figures() if f.source == "paper"]
    return {
        f.row: predict(f.cfg, f.gpu, memory=NO_MEM, stack=stack_of(f.stack))["tokens_per_sec_per_gpu"] for f in paper
    }


def _effects() -> list[dict]:
    from recipes.report.dryrun_table import bench_tps, published_effects

    ref = {
        r.id: r.reference["paper_tps_per_gpu"] for r in registry.all_recipes() if r.reference.get("paper_tps_per_gpu")
    }
    return published_effects({rid: as_the_paper_ran_it()[rid] for rid in ref}, ref, bench_tps())


def test_goals_against_the_paper():
    """Reports every goal; asserts those the model meets today (a regression fails the test)."""
    rows = [
        (r.id, r.reference["paper_tps_per_gpu"], as_the_paper_ran_it()[r.id])
        for r in registry.all_recipes()
        if r.reference.get("paper_tps_per_gpu")
    ]
    within = [rid for rid, paper, ours in rows if abs(ours - paper) / paper * 100 <= PCT_GOAL]
    within10 = [rid for rid, paper, ours in rows if abs(ours - paper) / paper * 100 <= 10.0]
    print(f"\npredicted TPS/GPU within {PCT_GOAL:.0f}%: {len(within)} of {len(rows)} (goal {ROWS_GOAL})")
    print(f"predicted TPS/GPU within 10%: {len(within10)} of {len(rows)}")
    for rid, paper, ours in rows:
        print(f"  {rid:55s} paper {paper:6.0f}  predicted {ours:7.1f}  {(ours - paper) / paper * 100:+6.1f}%")
    met = {}
    effects = _effects()
    assert len(effects) == 12
    for e in effects:
        met[e["effect"]] = e["met"]
        print(
            f"  {e['effect']:60s} paper {e['paper']:6.1f}  predicted {e['predicted']:6.1f}  "
            f"{'met' if e['met'] else 'MISSED'}"
        )
    # What the model meets today (see the report for the misses and why).
    assert len(within) >= MET_ROWS and len(within10) >= MET_ROWS_10
    for name in MET_EFFECTS:
        assert met[name], name


# 12 within 10%: the paper's two 70B rows (897 and 1,010) sit 8-11% above torchtitan's later runs
# of the same layout (829 and 876 in Dec 2024, 809.8 in Jun 2025), and the model, which now
# prices sequence parallelism's reordering copies (core/dryrun/asynctp.py), predicts 795 and 909;
# the paper's 8B Float8 row at 8 GPUs (9,409, against 8,532 in the Dec 2024 re-run) is predicted
# 10.0% low since the precomputed scales' max-norm after the optimizer step is priced (was 9.9%).
MET_ROWS, MET_ROWS_10 = 17, 12
MET_EFFECTS = (
    "compile, Table 1 at 8 GPUs (gain %)",
    "compile, Table 1 at 128 GPUs (gain %)",
    "Float8, Table 1 at 8 GPUs (gain % over FSDP)",
    "Float8, Table 1 at 128 GPUs (gain % over FSDP)",
    "AsyncTP, Table 2 (gain %)",
    "Interleaved 1F1B over 1F1B, Table 3 (gain %)",
    "Table 4 CP doubling to 2 (TPS ratio x 100)",
    "Table 4 CP doubling to 8 (TPS ratio x 100)",
    "Table 5 CP doubling to 2 (TPS ratio x 100)",
    "Table 5 CP doubling to 4 (TPS ratio x 100)",
    "Table 5 CP doubling to 8 (TPS ratio x 100)",
)


def test_fitted_constants_are_what_their_named_figures_give():
    """The four fitted constants are reproducible from their named public figures; each spec that
    holds one names it (constant and figure) in its calibration note, which predictions carry;
    every other spec calibrates nothing."""
    from core.dryrun import calibrate
    from recipes.report import perf_validation

    assert len(calibrate.FITS) <= 4 and len({f.figure for f in calibrate.FITS}) <= 4
    fitted = calibrate.fit(perf_validation.fit_targets())
    holders = set()
    for f in calibrate.FITS:
        named = f.row if f.figure == f"paper/{f.row}" else f.figure
        for name in f.specs:
            holders.add(name)
            spec = G.load_spec(name)
            assert getattr(spec, f.field) == pytest.approx(fitted[f.figure], abs=0.002), (name, f.field)
            assert f"compute.{f.field} on {named}" in spec.calibration, name
    note = predict(cfg_of(ROWS[0]), PAPER, memory=NO_MEM)["calibration"]
    assert "llama3_8b/table1/8gpu_fsdp_compile" in note
    for name in set(G.known_gpus()) - holders:
        assert not G.load_spec(name).calibration, name
