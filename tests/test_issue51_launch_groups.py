"""Issue 51, real mode at scale: the groups made with a timeout of their own (the checkpoint's,
the async-save poll group, the profiler's gather) keep it when the training timeout is applied
after step 1 (core/group_timeouts.py); the AsyncTP hardware probe (nvidia-smi, up to 20 s) runs
once per process and once per node, its verdict read by the node's other ranks, and never where
it is given (TITAN_NVLINK_ALL_PAIRS) or where there is no nvidia-smi."""

from __future__ import annotations

import stat
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch.distributed as dist

from core import train as train_module
from core.checkpoint.checkpointer import Checkpointer
from core.config import load_config
from core.debug import pg_timeout_seconds
from core.group_timeouts import keep_own_timeout, own_timeout_groups
from core.step_hooks import StepProfiler
from core.toggles import async_tp
from core.train import run
from core.validate import validate
from tests.dist_utils import ROOT, TINY_JOB

pytestmark = pytest.mark.realpath


# ------------------------------------------------------------------- groups with their own timeout
def test_groups_made_with_their_own_timeout_keep_it_after_step_one(pg, tmp_path, monkeypatch):
    """A world-1 run with an async checkpoint and the profiler: after step 1 the default group has
    the training timeout, and the checkpoint's group, its poll group and the profiler's gather
    group the ones they were made with (the profiler makes its group for several ranks only: it is
    told there are two while it is made)."""
    made = {}

    class Ckpt(Checkpointer):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            made["ckpt"] = self

    class Profiler(StepProfiler):
        def __init__(self, *a, **k):
            with pytest.MonkeyPatch.context() as m:
                m.setattr(dist, "get_world_size", lambda group=None: 2)
                super().__init__(*a, **k)
            made["profiler"] = self

    monkeypatch.setattr(train_module, "Checkpointer", Ckpt)
    monkeypatch.setattr(train_module, "StepProfiler", Profiler)
    times = ["--comm.checkpoint_timeout_seconds=1234", "--comm.init_timeout_seconds=555"]
    overrides = [*TINY_JOB, f"--job.output_dir={tmp_path}", "--training.steps=3", "--comm.train_timeout_seconds=77"]
    overrides += ["--checkpoint.enabled=true", "--checkpoint.async_mode=async", "--checkpoint.interval=1"]
    overrides += ["--profiling.enabled=true", "--profiling.start_step=2", "--profiling.steps=1", *times]
    run(validate(load_config(None, overrides), 1, check_files=False))
    ckpt, profiler = made["ckpt"], made["profiler"]
    assert profiler.group is not None and ckpt.poll_pg is not None
    assert pg_timeout_seconds() == 77  # every other group: the training timeout
    assert pg_timeout_seconds(ckpt.pg) == 1234
    assert pg_timeout_seconds(ckpt.poll_pg) == 555  # comm.init_timeout_seconds, as made
    assert pg_timeout_seconds(profiler.group) == 1234  # the trainer gives it the checkpoint's
    assert {id(g) for g in (ckpt.pg, ckpt.poll_pg, profiler.group)} <= {id(g) for g in own_timeout_groups()}
    assert keep_own_timeout(None) is None


# ------------------------------------------------------------------------------ AsyncTP probe
TOPOLOGY = "\tGPU0\tGPU1\tCPU Affinity\nGPU0\t X \t{link}\t0-15\nGPU1\t{link}\t X \t0-15\n"


def _fake_nvidia_smi(folder: Path, link: str = "NV18") -> Path:
    """nvidia-smi that counts its runs (one line each in `calls`) and prints a 2-GPU topology."""
    folder.mkdir(parents=True, exist_ok=True)
    calls = folder / "calls"
    exe = folder / "nvidia-smi"
    exe.write_text(f"#!/bin/bash\necho run >> '{calls}'\nsleep 0.3\nprintf '{TOPOLOGY.format(link=link)}'\n")
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    return calls


def _runs(calls: Path) -> int:
    return len(calls.read_text().splitlines()) if calls.exists() else 0


@pytest.fixture
def probe(tmp_path, monkeypatch):
    """A node with the fake nvidia-smi, a temp folder of its own and no verdict given."""
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:/usr/bin:/bin")
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    monkeypatch.delenv(async_tp.NVLINK_ENV, raising=False)
    monkeypatch.setattr("tempfile.tempdir", None)  # gettempdir() reads TMPDIR again
    async_tp._node_verdict.cache_clear()
    yield tmp_path
    async_tp._node_verdict.cache_clear()


def test_the_probe_runs_once_per_process(probe, monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    calls = _fake_nvidia_smi(probe / "bin")
    assert all(async_tp._nvlink_between_all_gpus(2) for _ in range(4))  # start + one per pipeline stage
    assert _runs(calls) == 1


def test_the_probe_runs_once_per_node_and_the_other_ranks_read_its_verdict(probe, monkeypatch):
    """Eight local ranks of one launch (threads here: the same agent, each its own lock) ask at
    once: nvidia-smi runs once, and each reads its verdict (no NVLink between the two GPUs)."""
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-7")
    calls = _fake_nvidia_smi(probe / "bin", link="PHB")
    verdicts = []
    ranks = [threading.Thread(target=lambda: verdicts.append(async_tp._node_verdict.__wrapped__(2))) for _ in range(8)]
    for t in ranks:
        t.start()
    for t in ranks:
        t.join()
    assert verdicts == [False] * 8 and _runs(calls) == 1


def test_ranks_in_processes_of_one_agent_share_one_answer(tmp_path):
    """Processes of one parent (the ranks of one torchrun agent) ask at once: one computes, the
    other reads its answer."""
    calls = tmp_path / "calls"
    code = (
        "import time\nfrom core.process import once_per_node\n"
        f"def probe():\n    open({str(calls)!r}, 'a').write('run\\n')\n    time.sleep(0.3)\n    return 'NV'\n"
        "print(once_per_node('nvlink_2', probe))\n"
    )
    parent = (
        "import subprocess, sys\n"
        f"ps = [subprocess.Popen([sys.executable, '-c', {code!r}], stdout=subprocess.PIPE, text=True)\n"
        "      for _ in range(2)]\n"
        "print(''.join(p.communicate()[0] for p in ps), end='')\n"
    )
    env = {"PATH": "/usr/bin:/bin", "TMPDIR": str(tmp_path), "TORCHELASTIC_RUN_ID": "job-8"}
    out = subprocess.run([sys.executable, "-c", parent], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["NV", "NV"] and _runs(calls) == 1


def test_nothing_probes_where_the_verdict_is_given_or_there_is_no_nvidia_smi(probe, monkeypatch):
    calls = _fake_nvidia_smi(probe / "bin")
    monkeypatch.setenv(async_tp.NVLINK_ENV, "0")
    assert async_tp._nvlink_between_all_gpus(2) is False
    monkeypatch.setenv(async_tp.NVLINK_ENV, "1")
    assert async_tp._nvlink_between_all_gpus(2) is True
    assert _runs(calls) == 0
    monkeypatch.delenv(async_tp.NVLINK_ENV)
    (probe / "bin" / "nvidia-smi").unlink()  # a CPU machine: CUDA peer access alone decides
    assert async_tp._nvlink_between_all_gpus(2) is True and _runs(calls) == 0
