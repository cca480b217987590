"""Measuring a device into a GPU spec (recipes/gpu_spec/, `run-recipe gpu-spec --measure`) and the
one-device comparison (`run-recipe preflight --gpus 1`): device selection, refusals without the
hardware, the spec written and read back through the shipped specs' validation and `--gpu FILE`,
and the whole path on this CPU (slow: it spawns gloo ranks, or trains)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from core.dryrun import gpuspec as G
from recipes.gpu_spec import collectives
from recipes.gpu_spec.assemble import spec_document
from recipes.gpu_spec.device import CannotMeasure, Device, base_spec, gemm_support, select_device
from recipes.gpu_spec.run import Measurements

pytestmark = pytest.mark.perfmodel

ROOT = Path(__file__).resolve().parents[1]
NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
CPU = Device("cpu", "cpu (test)", torch.__version__, "no GPU driver (CPU)", 1, None, 8.0)
H100 = Device("cuda", "NVIDIA H100 80GB HBM3", torch.__version__, "driver 0, CUDA 0", 1, (9, 0), 79.6)


def _cli(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    """`run-recipe ARGS` as a user runs it (its own process: gloo ranks, a trainer's process group)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "recipes.cli", *args]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def _measurements(dev: Device, collectives_: dict | None) -> Measurements:
    """Measurements as the benchmarks leave them (numbers of this CPU's order), for the assembly."""
    m = Measurements(
        dev,
        3,
        {"bf16": [(1024, 256, 256, 4.0e10), (1024, 768, 256, 5.0e10), (4352, 256, 1024, 4.5e10)]},
        {k: r for k, r in gemm_support(dev).items() if r} if dev.kind == "cpu" else {"fp8_rowwise": "not asked for"},
        256,
        (4, 16, 16, True),
        786432,
        "debug TP 1 seq 256 x 4",
        attention=[(128, 1.0e10, 7.0e9), (256, 1.4e10, 1.2e10)],
        copy_bps=9e9,
        pointwise_bps=1.2e10,
        kernel_overhead_s=3e-5,
        collectives=collectives_,
        collectives_skipped="" if collectives_ else "one GPU on this node: no collective to measure",
        wall_s=1.0,
    )
    if dev.kind == "cuda":
        m.gemm["fp8_tensorwise"] = [(8192, 1024, 4096, 1.2e15)]
    return m


GLOO = {
    "world": 2,
    "backend": "gloo",
    "bytes": 16 << 20,
    "all_gather": {"tiny_s": 3e-4, "large_s": 0.1, "busbw": 8.4e7},
    "reduce_scatter": {"tiny_s": 3e-4, "large_s": 0.1, "busbw": 8.4e7},
    "all_reduce": {"tiny_s": 5e-4, "large_s": 0.15, "busbw": 1.1e8},
    "busbw": 8.4e7,
    "peak_busbw": 1.1e8,
    "base_latency_s": 1e-4,
    "step_latency_s": 2e-4,
}


# ------------------------------------------------------------------------------ the device
def test_device_selection_on_this_machine():
    dev = select_device("auto")
    assert dev.kind == ("cuda" if torch.cuda.is_available() else "cpu")
    cpu = select_device("cpu", threads=torch.get_num_threads())
    assert cpu.kind == "cpu" and cpu.name.startswith("cpu (") and cpu.threads >= 1 and cpu.memory_gib > 0
    assert cpu.torch_version == torch.__version__ and cpu.driver
    with pytest.raises(ValueError, match="auto, cuda or cpu"):
        select_device("tpu")


@NO_CUDA
def test_cuda_asked_for_without_one_is_refused():
    with pytest.raises(CannotMeasure, match="no CUDA GPU to measure"):
        select_device("cuda")


def test_float8_kinds_a_device_lacks_say_why():
    support = gemm_support(CPU)
    assert support["bf16"] is None
    assert all("no float8 matmul on a CPU" in support[k] for k in ("fp8_tensorwise", "fp8_rowwise"))
    a100 = Device("cuda", "NVIDIA A100-SXM4-80GB", torch.__version__, "", 1, (8, 0), 79.2)
    assert all("sm80" in gemm_support(a100)[k] for k in ("fp8_tensorwise", "fp8_rowwise"))
    # the shipped spec of a GPU model is matched by the name CUDA reports; none for others
    assert base_spec(H100) == "h100_sxm_80gb" and base_spec(a100) is None and base_spec(CPU) is None


def test_latencies_from_tiny_collectives():
    # n = 2: ring all-gather = base + step, tree all-reduce = base + 2 step
    base, step = collectives.latencies(2, 3e-4, 5e-4)
    assert base == pytest.approx(1e-4) and step == pytest.approx(2e-4)
    # a noisy pair (the tree faster than the ring) falls back to an even split, still positive
    assert collectives.latencies(2, 3e-4, 2e-4) == (1.5e-4, 1.5e-4)


# ---------------------------------------------------------------------------- the spec written
def test_cpu_spec_written_loads_through_the_shipped_validation(tmp_path):
    text, spec = spec_document(_measurements(CPU, GLOO), "measured_test_cpu", None)
    path = tmp_path / "cpu.toml"
    path.write_text(text)
    loaded = G.load_spec(str(path))
    assert loaded == spec and loaded.name == "measured_test_cpu"
    assert loaded.measured.startswith(f"{time.strftime('%Y-%m-%d')} on cpu (test)")
    # on a CPU the peaks are measured: the fastest GEMM / attention kernel, the faster stream
    assert loaded.peak_bf16_flops == 5.0e10 and loaded.hbm_bandwidth == 1.2e10 and loaded.hbm == 1.0
    assert loaded.clock_fraction == 1.0 and loaded.kernel_overhead_s == 3e-5
    assert [p.efficiency for p in loaded.gemm_points("bf16")] == [0.8, 1.0, 0.9]
    assert all(p.measured == time.strftime("%Y-%m-%d") for p in loaded.gemm_points("bf16"))
    assert not loaded.gemm_points("fp8_tensorwise")  # not measured: the model refuses Float8 on it
    doc = __import__("tomllib").loads(text)
    assert "compute.peak_bf16_flops" in doc["measured"]["fields"] and "gemm.bf16" in doc["measured"]["fields"]
    assert "links.network_bandwidth" not in doc["measured"]["fields"]  # one node: stood in, not measured
    assert "fp8_tensorwise" in doc["measured"]["skipped"]


def test_gpu_spec_keeps_the_datasheet_of_its_base(tmp_path):
    """On a GPU with a shipped spec, the peaks, the network and the fitted clock stay the base's;
    the measurements become the efficiencies beside them."""
    base = G.load_spec("h100_sxm_80gb")
    text, spec = spec_document(_measurements(H100, None), "measured_h100", "h100_sxm_80gb")
    assert spec.peak_bf16_flops == base.peak_bf16_flops and spec.network_bandwidth == base.network_bandwidth
    assert spec.clock_fraction == base.clock_fraction and "h100_sxm_80gb" in spec.calibration
    assert spec.gemm_points("bf16")[1].efficiency == pytest.approx(5.0e10 / base.peak_bf16_flops, rel=1e-5)
    assert spec.gemm_points("fp8_tensorwise")[0].efficiency == pytest.approx(1.2e15 / base.peak_fp8_flops, rel=1e-5)
    assert spec.nvlink_bandwidth == base.nvlink_bandwidth  # one GPU: no collective measured
    doc = __import__("tomllib").loads(text)
    assert "compute.peak_bf16_flops" not in doc["measured"]["fields"]
    assert "efficiency.nccl_nvlink" not in doc["measured"]["fields"]


def test_bad_spec_files_are_refused_naming_the_field(tmp_path):
    text, _ = spec_document(_measurements(CPU, GLOO), "measured_test_cpu", None)
    cases = {
        "fields": (text.replace('fields = ["', 'fields = ["compute.warp_speed", "'), "measured.fields"),
        "date": (text.replace('date = "', 'date = "yesterday'), "measured.date"),
        "eff": (text.replace("hbm = 1\n", "hbm = 1.5\n"), "efficiency.hbm"),
    }
    for name, (bad, field) in cases.items():
        path = tmp_path / f"{name}.toml"
        path.write_text(bad)
        with pytest.raises(G.SpecError, match=field.replace(".", r"\.")):
            G.load_spec(str(path))
    with pytest.raises(G.SpecError, match="does not exist"):
        G.load_spec(str(tmp_path / "none.toml"))


def test_gpu_file_is_taken_where_a_spec_name_is(tmp_path):
    """--gpu FILE: the dry-run record (core.dryrun.record), the model and `run-recipe plan`."""
    from core.dryrun.record import dry_run
    from core.validate import validate
    from recipes.gpu_spec.shapes import PROXY, layout_config
    from recipes.plan.layouts import plan

    path = tmp_path / "cpu.toml"
    path.write_text(spec_document(_measurements(CPU, GLOO), "measured_test_cpu", None)[0])
    cfg = validate(layout_config(PROXY["flavor"], PROXY["seq"], PROXY["local_batch"]), 1, check_files=False)
    record = dry_run(cfg, fake=False, gpu=str(path))
    assert record["predicted"]["gpu"] == "measured_test_cpu" and record["predicted"]["step_time_s"] > 0
    res = CliRunner().invoke(plan, ["--model", "8B", "--gpus", "8", "--gpu", str(path), "--json"])
    assert res.exit_code == 0, res.output
    ranked = json.loads(res.output)
    assert {r["gpu"] for r in ranked} == {"measured_test_cpu"}
    # a CPU predicts under one token/s per GPU for 8B: printed with its significant digits, not as 0
    assert 0 < ranked[0]["tokens_per_sec_per_gpu"] < 1
    res = CliRunner().invoke(plan, ["--model", "8B", "--gpus", "8", "--gpu", str(path), "--top", "1"])
    row = next(line for line in res.output.splitlines() if line.lstrip().startswith("1  "))
    assert f" {ranked[0]['tokens_per_sec_per_gpu']:.3g} " in row, row


# ------------------------------------------------------------------------------------ refusals
def test_a_float8_benchmark_the_device_lacks_is_refused_and_nothing_written(tmp_path):
    out = tmp_path / "spec.toml"
    from recipes.gpu_spec.command import gpu_spec

    res = CliRunner().invoke(gpu_spec, ["--measure", "--device", "cpu", "--gemm", "fp8_rowwise", "--out", str(out)])
    assert res.exit_code == 3, res.output
    assert "gemm fp8_rowwise: no float8 matmul on a CPU" in res.output and "no spec written" in res.output
    assert not out.exists()


@NO_CUDA
def test_cuda_only_paths_refused_without_a_gpu(tmp_path):
    from recipes.gpu_spec.command import gpu_spec
    from recipes.studies.preflight import preflight

    res = CliRunner().invoke(gpu_spec, ["--measure", "--device", "cuda", "--out", str(tmp_path / "s.toml")])
    assert res.exit_code == 3 and "no CUDA GPU to measure" in res.output
    assert not (tmp_path / "s.toml").exists()
    res = CliRunner().invoke(preflight, ["--gpus", "1", "--device", "cuda", "--out", str(tmp_path / "pf")])
    assert res.exit_code == 3 and "no CUDA GPU to measure" in res.output
    assert not (tmp_path / "pf" / "comparison.json").exists()
    res = CliRunner().invoke(preflight, ["--gpus", "2", "--out", str(tmp_path / "pf")])
    assert res.exit_code == 2 and "--gpus" in res.output


# ---------------------------------------------------------------------------- on this machine
@pytest.mark.slow
def test_measure_this_cpu_quick(tmp_path):
    """The command end to end (2 gloo ranks spawned): exit 0, progress shown, a spec `--gpu FILE`
    takes, with every GEMM shape of the measured model."""
    from core.dryrun.linears import model_gemms
    from recipes.gpu_spec.shapes import measured_configs

    out = tmp_path / "cpu.toml"
    t0 = time.perf_counter()
    res = _cli("gpu-spec", "--measure", "--quick", "--device", "cpu", "--threads", "1", "--out", str(out))
    took = time.perf_counter() - t0
    assert res.returncode == 0, res.stdout + res.stderr
    assert "pass 1/3" in res.stdout and "collectives (gloo, 2 local ranks" in res.stdout
    assert "skipped: gemm fp8_tensorwise" in res.stdout and f"wrote {out}" in res.stdout
    spec = G.load_spec(str(out))
    shapes = {(p.m, p.n, p.k) for p in spec.gemm_points("bf16")}
    assert shapes == set(model_gemms(measured_configs("cpu", quick=True)[0]))
    assert spec.nvlink_bandwidth > 0 and "1 thread" in spec.measured
    print(f"\ngpu-spec --measure --quick on this CPU: {took:.0f} s")


@pytest.mark.slow
def test_preflight_one_device_cpu_form_quick(tmp_path):
    """measure -> spec -> predict -> run -> compare, at the tests' sizes: each AC mode measured and
    predicted from the spec measured in the same round."""
    res = _cli("preflight", "--gpus", "1", "--quick", "--rounds", "1", "--steps", "2", "--out", str(tmp_path))
    assert res.returncode == 0, res.stdout + res.stderr
    summary = json.loads((tmp_path / "comparison.json").read_text())
    assert set(summary["layouts"]) == {"bf16, AC none", "bf16, AC full", "bf16, AC selective"}
    for d in summary["layouts"].values():
        assert d["measured_s"][0] > 0 and d["predicted_s"]["measured"][0] > 0 and d["memory_gib"][0] > 0
    assert G.load_spec(summary["specs"][0]).measured and summary["versions"]["torch"] == torch.__version__
    assert "SKIP  Float8 tensorwise: no float8 matmul on a CPU" in res.stdout


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (sm89+ for the Float8 GEMMs): none here")
def test_measure_this_gpu(tmp_path):
    """On a CUDA GPU: the GEMM tables of every kernel family it runs, the spec loads."""
    out = tmp_path / "gpu.toml"
    res = _cli("gpu-spec", "--measure", "--quick", "--device", "cuda", "--out", str(out), timeout=1200)
    if res.returncode == 3 and "--base" in res.stderr:
        pytest.skip(f"one GPU of a model without a shipped spec: {res.stderr.strip()}")
    assert res.returncode == 0, res.stdout + res.stderr
    spec = G.load_spec(str(out))
    support = gemm_support(select_device("cuda"))
    assert {k for k, _ in spec.gemm} == {k for k, why in support.items() if why is None}
    assert all(0 < p.efficiency <= 1 for _, points in spec.gemm for p in points)


def test_typical_leaves_out_the_tails():
    """A rare long stall (or a lucky sample) moves neither a probe's rate nor a step's."""
    from recipes.gpu_spec.benchmarks import typical

    assert typical([1.0, 1.0, 2.0, 1.0, 100.0]) == pytest.approx(4 / 3)
    assert typical([1.0, 3.0]) == 2.0  # too few to trim


def test_the_verdict_is_the_median_error_of_each_bf16_layout():
    from recipes.studies.preflight_one import TARGET, Run, _summary, comparison_table

    def run(ac: str, measured: float, predicted: float, r: int) -> Run:
        return Run(f"bf16, AC {ac}", "bf16", ac, [measured] * 3, 0.2, {"measured": predicted}, 0.19, 1.0)

    # AC none: one round off by 60%, the median of three within TARGET; AC full: off in two of three
    runs = [run("none", 1.0, p, r) for r, p in enumerate((0.9, 1.6, 1.1))]
    runs += [run("full", 1.0, p, r) for r, p in enumerate((0.7, 0.95, 0.6))]
    s = _summary(runs, [], "cpu (test)")
    assert s["target"] == TARGET and not s["passed"] and s["misses"] == ["bf16, AC full: -30.0%"]
    assert s["layouts"]["bf16, AC none"]["error"]["measured"] == pytest.approx([-0.1, 0.6, 0.1])
    assert "+10.0% [-10.0%, +60.0%]" in comparison_table(s)


def test_a_cuda_sample_is_many_calls_not_one_call_and_its_synchronize(monkeypatch):
    """Sized from a cold first call, a small kernel's sample was one launch plus the synchronize
    (133.6 us of "kernel overhead" on an H200): the batch grows until a sample lasts CUDA_SAMPLE_S,
    so a sample's fixed cost is a small share of each call's figure."""
    from recipes.gpu_spec import benchmarks as B

    call_s, sync_s = 50e-6, 1e-3

    def busy(seconds: float) -> None:
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            pass

    dev = Device("cuda", "test", torch.__version__, "none", 1, (9, 0), 1.0)
    monkeypatch.setattr(Device, "sync", lambda self: busy(sync_s))
    probe = B.Probe("small kernel", lambda: busy(call_s), 1.0)
    B.run_probes(dev, [probe], passes=3, progress=lambda _: None)
    assert probe.inner * call_s >= B.CUDA_SAMPLE_S / 2
    # one call and a sync would be 21x; a neighbour's load only adds time (6.7e-5 s in a CI run)
    assert call_s * 0.7 <= probe.seconds <= call_s * 3


def test_pointwise_products_read_two_tensors():
    """The bytes a product is credited with are read from two tensors (`x * x` reads one)."""
    from recipes.gpu_spec.benchmarks import pointwise_probes

    probes = pointwise_probes(select_device("cpu"), 1024)
    products = [p for p in probes if p.label.split()[1:4:2] in (["bf16", "bf16"], ["fp32", "fp32"])]
    assert len(products) == 2
    for probe in products:  # the lambda's tensors: two distinct ones
        assert len(probe.call.__code__.co_freevars) == 2, probe.label


def test_profile_summary_counts_each_kernel_once():
    """scripts/gpu_profile_one.py sums only device kernels: the op table also carries each
    triton kernel's device time on its launcher row and each GEMM's on aten::mm, so counting
    rows blindly gives more device time than the step lasted. Checked on the committed H200
    profiles: the kinds add up to no more than the slowest steady step of the same run."""
    import importlib.util
    import re

    spec = importlib.util.spec_from_file_location("gpu_profile_one", ROOT / "scripts" / "gpu_profile_one.py")
    profile = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(profile)
    folder = ROOT / "results" / "gpu" / "2026-11-27-nvidia-h200-6da30e3"
    for precision in ("bf16", "float8"):
        by_kind = profile.ms_by_kind(folder / f"profile_{precision}_8_blocks_ops.csv")
        log = (folder / f"profile_{precision}_8_blocks.log").read_text()
        steps = [float(s) for s in re.search(r"steps \[([^\]]+)\]", log).group(1).split(",")]
        assert 0.8 * min(steps) * 1e3 <= by_kind.sum() <= max(steps) * 1e3, (precision, by_kind.sum(), steps)
        assert {"gemm", "attention (cuDNN SDPA)", "optimizer + grad clip"} <= set(by_kind.index)
