"""What a multi-node launch carries to every node, whichever form starts it (the printed command,
the sbatch script): --max-restarts, the node's environment, the open-file limit (which a rank also
raises itself: core/process.py)."""

from __future__ import annotations

import os
import resource
import shlex
import subprocess
import sys

import pytest

from recipes import cluster_env
from tests.dist_utils import ROOT
from tests.fault_utils import invoke

pytestmark = pytest.mark.realpath
MULTI = "llama3_8b/table1/128gpu_fsdp"  # 16 nodes x 8


def _run(*args):
    """`run-recipe run` of a multi-node row, which prints or writes its launch: nothing spawned."""
    with pytest.MonkeyPatch.context() as m:
        m.setattr(subprocess, "Popen", lambda *a, **k: (_ for _ in ()).throw(AssertionError("spawned")))
        return invoke("run", MULTI, "--mode", "real", *args)


def _printed(tmp_path, *args) -> str:
    res = _run("--out", str(tmp_path / "run"), *args)
    assert res.exit_code == 0, res.output
    return next(line.strip() for line in res.output.splitlines() if "torchrun --nnodes" in line)


def _sbatch(tmp_path, *args) -> str:
    res = _run("--slurm", "--out", str(tmp_path / "run"), *args)
    assert res.exit_code == 0, res.output
    script = (tmp_path / "run" / "sbatch.sh").read_text()
    subprocess.run(["bash", "-n"], input=script, text=True, check=True)
    return script


def test_max_restarts_reaches_torchrun_in_every_multinode_form(tmp_path):
    printed = _printed(tmp_path / "a", "--max-restarts", "2")
    assert "--max-restarts=2" in shlex.split(printed)
    srun = _sbatch(tmp_path / "b", "--max-restarts", "3").split("srun ", 1)[1]
    assert "--max-restarts=3" in srun.replace("\\\n", " ").split()
    assert "--max-restarts" not in _printed(tmp_path / "c") + _sbatch(tmp_path / "d")  # 0: torchrun's default


def test_printed_multinode_command_sets_the_env_of_a_local_launch(tmp_path, monkeypatch):
    """The node's shell evaluates the command's assignments as a local real launch sets them."""
    printed = _printed(tmp_path)
    prefix = printed.split(" torchrun ", 1)[0]
    env = {"PATH": os.environ["PATH"], "TMPDIR": "/local", "USER": "u"}
    out = subprocess.run(["bash", "-c", f"{prefix} env"], env=env, capture_output=True, text=True, check=True).stdout
    got = dict(line.split("=", 1) for line in out.splitlines() if "=" in line)
    monkeypatch.setenv("TMPDIR", "/local")
    monkeypatch.setenv("USER", "u")
    for key in ("PYTORCH_CUDA_ALLOC_CONF", "TORCHINDUCTOR_CACHE_DIR"):  # as on a fresh node
        monkeypatch.delenv(key, raising=False)
    from recipes import modes

    local = modes.RealMode().env(8)
    for key in ("PYTORCH_CUDA_ALLOC_CONF", "TORCHINDUCTOR_CACHE_DIR"):
        assert got[key] == local[key], key
    assert got["TORCHINDUCTOR_CACHE_DIR"] == cluster_env.node_local_cache_dir() == "/local/titan_inductor_u"
    env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:False"  # the node's own value is kept
    out = subprocess.run(["bash", "-c", f"{prefix} env"], env=env, capture_output=True, text=True, check=True).stdout
    assert "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False" in out.splitlines()


# ------------------------------------------------------------------------ the open-file limit
def test_sbatch_raises_the_soft_open_file_limit_to_the_hard_one(tmp_path):
    script = _sbatch(tmp_path)
    line = next(x for x in cluster_env.sbatch_env_lines(8) if x.startswith("ulimit"))
    assert line in script.split("srun ", 1)[0]
    out = subprocess.run(
        ["bash", "-euc", f"ulimit -Sn 256; {line}; echo $(ulimit -Sn) $(ulimit -Hn)"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    assert out[0] == out[1] or out[1] == "unlimited", out


def test_a_rank_raises_its_soft_open_file_limit_to_the_hard_one():
    code = (
        "import resource; from core.process import raise_open_file_limit; "
        "hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]; "
        "resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard)); "
        "before, after = raise_open_file_limit(); "
        "print(before, after, resource.getrlimit(resource.RLIMIT_NOFILE)[0], hard)"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    before, after, now, hard = (int(x) for x in out.stdout.split())
    assert before == 256 and after == now and after > 256
    assert after == hard or hard == resource.RLIM_INFINITY
