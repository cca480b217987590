"""What real mode at the paper's scale needs, checked on a CPU: a refusal without CUDA on every
node, an sbatch job that cannot hang or run on CPUs, MFU only against a known peak, cuBLAS's
deterministic workspace, the run folder's lock held by the job, folders every node can read, and
one hub check per node."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest
import torch

from core import hardware, metrics, run_folder
from core.config import ConfigError, load_config
from core.metrics import PeakFlops
from core.result import _throughput
from recipes import launcher, multinode, registry
from tests.dist_utils import ROOT, TINY_JOB
from tests.fault_utils import invoke

pytestmark = pytest.mark.realpath

MULTI = "llama3_8b/table1/128gpu_fsdp"


def _trainer(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "core.train", *TINY_JOB, "--training.steps=1", *args]
    return subprocess.run(
        cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, env={**launcher.base_env(), **(env or {})}
    )


# ------------------------------------------------------------------ real mode needs its GPUs
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_real_mode_refuses_to_train_on_cpus(tmp_path):
    proc = _trainer("--job.mode=real", f"--job.output_dir={tmp_path}")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "config error: job.mode: real mode needs CUDA GPUs" in proc.stderr
    assert socket.gethostname() in proc.stderr or os.uname().nodename in proc.stderr
    assert not (tmp_path / "result.json").exists()


def test_real_mode_needs_a_gpu_per_local_rank(monkeypatch):
    cfg = load_config(None, ["--job.mode=real"])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    with pytest.raises(ConfigError, match=r"needs 8 GPUs on host .* 4 visible"):
        hardware.check_real_devices(cfg)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    hardware.check_real_devices(cfg)  # enough
    hardware.check_real_devices(load_config(None, ["--job.mode=proxy"]))  # proxies run anywhere


# ------------------------------------------------------------------------ the sbatch script
def _sbatch(tmp_path) -> str:
    recipe = registry.get(MULTI)
    cfg = registry.resolve_config(recipe, "real")
    return multinode.sbatch_script(recipe, cfg, tmp_path, nnodes=16, nproc=8, records_dir=None)


def test_sbatch_cannot_hang_on_a_dead_node_nor_run_on_cpus(tmp_path):
    script = _sbatch(tmp_path)
    lines = script.splitlines()
    srun = next(i for i, line in enumerate(lines) if line.startswith("srun"))
    assert f"--kill-on-bad-exit=1 --wait={multinode.SRUN_WAIT_S}" in lines[srun]
    check = next(i for i, line in enumerate(lines) if "torch.cuda.is_available()" in line)
    assert check < srun and f"# Python environment: {sys.prefix}" in script
    assert f"export {run_folder.RUN_LOCK_ENV}=1" in script
    # this machine's torch has no CUDA: the job's check stops it, saying why, exit 3
    proc = subprocess.run(["bash", "-c", lines[check]], capture_output=True, text=True, timeout=120)
    if not torch.cuda.is_available():
        assert proc.returncode == 3 and "has no CUDA" in proc.stderr and sys.prefix in proc.stderr
    subprocess.run(["bash", "-n"], input=script, text=True, check=True)


def test_slurm_warns_when_the_run_folder_is_node_local(tmp_path):
    res = invoke("run", MULTI, "--mode", "real", "--slurm", "--out", str(tmp_path / "run"))
    assert res.exit_code == 0, res.output
    assert "warning:" in res.output and "node-local" in res.output and "shared file system" in res.output


def test_the_job_takes_the_run_folder_lock(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    with run_folder.lock(out):  # a live run owns the folder: every rank of the job stops
        proc = _trainer(f"--job.output_dir={out}", env={run_folder.RUN_LOCK_ENV: "1"})
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert f"in use by another run (pid {os.getpid()}" in proc.stderr
    assert not (out / "result.json").exists()
    proc = _trainer(f"--job.output_dir={out}", env={run_folder.RUN_LOCK_ENV: "1"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (out / "result.json").is_file() and not (out / run_folder.LOCK).exists()  # released at the end


# ----------------------------------------------------------------------------- MFU, cuBLAS
@pytest.mark.parametrize(
    "gpu", ["NVIDIA H800", "NVIDIA H20", "NVIDIA L40S", "NVIDIA GeForce RTX 4090", "NVIDIA H200 NVL", "NVIDIA GB200"]
)
def test_no_mfu_against_an_unknown_peak(gpu, monkeypatch):
    assert metrics.cuda_peak_flops(gpu) is None
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: gpu)
    info = metrics.device_info()
    assert info["peak_flops"] is None and "metrics.peak_flops" in info["peak_source"]
    assert metrics.cuda_peak_flops("NVIDIA H100 80GB HBM3") == 989e12


@pytest.mark.parametrize(
    ("name", "model"),
    [
        ("NVIDIA H100 80GB HBM3", "H100 SXM"),
        ("NVIDIA H100 PCIe", "H100 PCIe"),
        ("NVIDIA H100 NVL", "H100 NVL"),
        ("NVIDIA H200", "H200 SXM"),
        ("NVIDIA H200 NVL", "H200 NVL"),  # not the SXM part: no peak of its own here
        ("NVIDIA B200", "B200 SXM"),
        ("NVIDIA GB200", "GB200 SXM"),  # not a B200
        ("NVIDIA A100-SXM4-80GB", "A100 SXM"),
        ("NVIDIA A100 80GB PCIe", "A100 PCIe"),
        ("AMD Instinct MI300X", "MI300X"),
        ("NVIDIA H100 80GB HBM3 MIG 1g.10gb", None),  # a slice: not the whole part's peak
    ],
)
def test_a_gpu_is_matched_by_its_whole_name(name, model):
    from recipes.gpu_spec.device import Device, base_spec

    assert metrics.gpu_model(name) == model
    assert metrics.cuda_peak_flops(name) == metrics.PEAK_FLOPS.get(model or "")
    shipped = {"H100 SXM": "h100_sxm_80gb", "H200 SXM": "h200_141gb", "B200 SXM": "b200"}
    assert base_spec(Device("cuda", name, torch.__version__, "", 1, (9, 0), 79.2)) == shipped.get(model or "")


def test_mfu_is_empty_without_a_peak():
    class Outcome:
        step_times_s, data_times_s = [1.0, 1.0], [0.1, 0.1]
        tokens_per_step, world_size, flops_per_token = 8192, 8, 6e9
        peak = PeakFlops(None, "no peak known", None)

    out = _throughput(Outcome())
    assert out["mfu"] is None and out["tokens_per_sec_per_device"] == 1024.0


def test_deterministic_runs_fix_cublas_workspace(tmp_path):
    code = (
        "import os, sys; from core import train; "
        "train.init_distributed = lambda cfg: sys.exit(print(os.environ.get('CUBLAS_WORKSPACE_CONFIG')) or 0); "
        "train.main(sys.argv[1:])"
    )
    base = [*TINY_JOB, f"--job.output_dir={tmp_path}"]
    env = {k: v for k, v in launcher.base_env().items() if k != "CUBLAS_WORKSPACE_CONFIG"}
    det = subprocess.run(
        [sys.executable, "-c", code, *base, "--job.deterministic=true"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=env,
    )
    plain = subprocess.run([sys.executable, "-c", code, *base], cwd=ROOT, capture_output=True, text=True, env=env)
    assert det.stdout.strip() == ":4096:8", det.stderr[-1500:]
    assert plain.stdout.strip() == "None", plain.stderr[-1500:]


# ------------------------------------------------------------------------------ the hub
def test_the_hub_is_checked_once_per_node(monkeypatch):
    from core.data import datasets

    calls = []
    monkeypatch.setattr(datasets, "check_hub_reachable", lambda: calls.append(os.environ.get("LOCAL_RANK")))
    import datasets as hf

    monkeypatch.setattr(hf, "load_dataset", lambda *a, **k: _Stream())
    for local_rank in ("0", "1", "7"):
        monkeypatch.setenv("LOCAL_RANK", local_rank)
        datasets._open_c4(None, "train")
    assert calls == ["0"]


class _Stream:
    def state_dict(self):
        return {}


def test_the_steady_cuda_peak_starts_from_an_emptied_cache(monkeypatch):
    """Reserved memory counts the allocator's cached blocks: the peak reset after step 1 releases
    them first, or the steady peak could never fall below step 1's (preflight does the same)."""
    calls = []
    monkeypatch.setattr(metrics.torch.cuda, "is_available", lambda: True)
    for name in ("synchronize", "empty_cache", "reset_peak_memory_stats"):
        monkeypatch.setattr(metrics.torch.cuda, name, lambda n=name: calls.append(n))
    metrics.reset_peak_memory()
    assert calls == ["synchronize", "empty_cache", "reset_peak_memory_stats"]
