"""AMD Instinct GPU systems (core/dryrun/hardware/mi300x.toml, mi325x.toml, mi355x.toml): they load,
`plan --gpu mi300x` sizes with the part's memory, Float8 is what torchao runs on ROCm (tensorwise)
and rowwise is refused, saying why; the one public MI300X run is predicted."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from core.dryrun import gpuspec as G

AMD = ("mi300x", "mi325x", "mi355x")


@pytest.mark.parametrize("name", AMD)
def test_amd_spec_loads_with_its_capacity_and_fp8(name):
    spec = G.load_spec(name)
    assert spec.hbm_capacity_gib > 180 and spec.peak_fp8_flops > spec.peak_bf16_flops > 1e15
    assert spec.gemm_points("bf16") and spec.gemm_points("fp8_tensorwise")
    assert not spec.gemm_points("fp8_rowwise")  # no public rowwise rate: refused, not guessed
    assert name in G.known_gpus()


def test_plan_on_mi300x_sizes_with_its_memory():
    from recipes.cli import main

    res = CliRunner().invoke(main, ["plan", "--model", "8B", "--gpus", "8", "--gpu", "mi300x", "--json"])
    assert res.exit_code == 0, res.output
    ranked = json.loads(res.output)
    assert ranked[0]["gpu"] == "mi300x" and ranked[0]["fits"]
    assert all(r["tokens_per_sec_per_gpu"] > 0 for r in ranked)
    text = CliRunner().invoke(main, ["plan", "--model", "70B", "--gpus", "8", "--gpu", "mi300x"]).output
    assert "Memory per GPU: 191.5 GiB, mi300x's capacity (--gpu)" in text


def test_rowwise_float8_is_refused_on_mi300x_naming_the_missing_rate(tmp_path):
    from recipes.cli import main

    args = ["run", "llama3_8b/table1/8gpu_fsdp_compile_float8", "--mode", "dry-run", "--gpu", "mi300x"]
    sets = ['float8.recipe="rowwise"', "float8.enable_fsdp_float8_all_gather=false"]
    sets += ["float8.precompute_float8_dynamic_scale_for_fsdp=false"]
    res = CliRunner().invoke(main, [*args, *[x for s in sets for x in ("--set", s)], "--out", str(tmp_path / "r")])
    assert res.exit_code != 0 and "mi300x has no measured GEMM rate for fp8_rowwise" in res.output


def test_the_public_mi300x_run_is_predicted_and_its_memory_judged():
    from recipes.report import memory_validation, perf_validation

    figs = perf_validation.predict_all(perf_validation.figures())
    amd = {f.id: f for f in figs if f.gpu == "mi300x"}
    assert {"aomi300x/8b-8-bf16", "aomi300x/8b-8-tensorwise"} <= set(amd)
    assert amd["aomi300x/8b-8-bf16"].fitted and not amd["aomi300x/8b-8-tensorwise"].fitted
    judged = {f.id for f in memory_validation.judged(figs)}
    assert {"aomi300x/8b-8-bf16", "aomi300x/8b-8-tensorwise"} <= judged
    for f in amd.values():
        assert f.software.rocm and "ROCm" in f.software.short()
