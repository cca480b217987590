"""AsyncTP: the inductor pass and symmetric memory are wired for exactly the TP
group on an NVSwitch node, refused before launch elsewhere (real) or skipped with the reason
(proxy); the run itself needs 2+ CUDA GPUs joined by NVLink/NVSwitch."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import torch.distributed._symmetric_memory as symm_mem

from core.config import ConfigError, load_config
from core.hardware import check_toggle_hardware
from core.parallel.parallelize import Toggles
from core.toggles import async_tp
from core.toggles.async_tp import apply_async_tp
from core.validate import validate
from tests.dist_utils import ROOT, TINY_JOB, run_trainer

pytestmark = [pytest.mark.toggles]

BASE = [o.removeprefix("--") for o in TINY_JOB if not o.startswith("--training.steps")]  # steps: the default


class _FakeMesh:
    class _Group:
        group_name = "tp-group-7"

    def get_group(self):
        return self._Group()


def async_tp_cfg(mode="proxy"):
    return validate(
        load_config(
            None,
            BASE + ["parallelism.tp=2", "compile.enabled=true", "parallelism.enable_async_tp=true", f"job.mode={mode}"],
        ),
        2,
        check_files=False,
    )


def test_async_tp_wiring_on_a_cuda_machine(monkeypatch):
    """Pretend to be an NVSwitch node: the inductor pass is switched on and symmetric memory is
    enabled for exactly the TP group."""
    import torch._inductor.config as inductor_config  # ~1 s import: these tests only

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setattr(torch.cuda, "can_device_access_peer", lambda i, j: True)
    monkeypatch.setattr(async_tp, "_nvlink_between_all_gpus", lambda n: True)
    calls = []
    monkeypatch.setattr(symm_mem, "enable_symm_mem_for_group", calls.append)
    toggles = Toggles()
    for mode in ("real", "proxy"):
        calls.clear()
        # (inductor's config module: patch() restores it; monkeypatch's undo would delete the key)
        with inductor_config.patch(_micro_pipeline_tp=False):
            assert async_tp.apply_async_tp(_FakeMesh(), async_tp_cfg(mode), toggles)
            assert inductor_config._micro_pipeline_tp is True
        assert calls == ["tp-group-7"]
    assert toggles.applied == ["async_tp"] and not toggles.skipped
    assert check_toggle_hardware(async_tp_cfg("real")) == {}
    # peer access missing between two GPUs: refused (real) / skipped (proxy)
    monkeypatch.setattr(torch.cuda, "can_device_access_peer", lambda i, j: (i, j) != (0, 5))
    with pytest.raises(ConfigError, match="peer-to-peer"):
        check_toggle_hardware(async_tp_cfg("real"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_async_tp_refused_on_cpu():
    import torch._inductor.config as inductor_config  # ~1 s import: these tests only

    with pytest.raises(ConfigError, match="parallelism.enable_async_tp: .*CUDA.*NVSwitch"):
        check_toggle_hardware(async_tp_cfg("real"))
    with inductor_config.patch(_micro_pipeline_tp=False):
        with pytest.raises(ConfigError, match="parallelism.enable_async_tp"):
            apply_async_tp(_FakeMesh(), async_tp_cfg("real"), Toggles())
        # proxy: not applied, and the record says why
        assert "async_tp" in check_toggle_hardware(async_tp_cfg("proxy"))
        toggles = Toggles()
        assert not apply_async_tp(_FakeMesh(), async_tp_cfg("proxy"), toggles)
        assert "no CUDA device" in toggles.skipped["async_tp"] and not toggles.applied
        assert inductor_config._micro_pipeline_tp is False


def test_async_tp_config_needs_tp_and_compile():
    with pytest.raises(ConfigError, match="parallelism.enable_async_tp: needs tensor parallelism"):
        validate(
            load_config(None, BASE + ["parallelism.enable_async_tp=true", "compile.enabled=true"]), 1, check_files=False
        )
    with pytest.raises(ConfigError, match="parallelism.enable_async_tp: .*compile.enabled"):
        validate(
            load_config(None, BASE + ["parallelism.tp=2", "parallelism.enable_async_tp=true"]), 2, check_files=False
        )


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_trainer_refuses_real_async_tp_before_launch():
    """The trainer's entry point runs check_toggle_hardware after validate, before any process group."""
    cmd = [
        sys.executable,
        "-m",
        "core.train",
        *["--" + o for o in BASE],
        "--parallelism.tp=2",
        "--compile.enabled=true",
        "--parallelism.enable_async_tp=true",
        "--job.mode=real",
    ]
    proc = subprocess.run(cmd, check=False, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "config error: parallelism.enable_async_tp" in proc.stderr and "NVSwitch" in proc.stderr


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2,
    reason="needs 2+ CUDA GPUs joined by NVLink/NVSwitch (symmetric memory)",
)
@pytest.mark.slow
def test_async_tp_on_nvswitch_gpus(tmp_path):
    rec = run_trainer(
        2, TINY_JOB + ["--parallelism.tp=2", "--compile.enabled=true", "--parallelism.enable_async_tp=true"], tmp_path
    )
    assert "async_tp" in rec["toggles_applied"], rec["toggles_skipped"]
