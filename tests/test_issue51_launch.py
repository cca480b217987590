"""Issue 51, the launch: what a user types never becomes a line of a script (a newline or another
control character is refused with exit 2 before anything is written; every path is quoted and
reads back as given), and every multi-node launch (the printed command, the sbatch script) sets
the environment a local launch sets, from one list (recipes/cluster_env.py)."""

from __future__ import annotations

import os
import shlex
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from recipes import cluster_env, modes
from tests.fault_utils import invoke

pytestmark = pytest.mark.realpath
MULTI = "llama3_8b/table1/128gpu_fsdp"  # 16 nodes x 8
WEIRD = "we ird $HOME \"dq\" 'sq' `x` 100%j"  # spaces, both quotes, $, a backquote, sbatch's %
SHELL_OWN = {"PWD", "OLDPWD", "SHLVL", "_"}  # what bash itself sets


def _no_spawn(m: pytest.MonkeyPatch) -> None:
    m.setattr(subprocess, "Popen", lambda *a, **k: (_ for _ in ()).throw(AssertionError("spawned")))


def _files(folder: Path) -> list[Path]:
    return sorted(folder.rglob("*"))


# ---------------------------------------------------------------------- refused, nothing written
@pytest.mark.parametrize("bad", ["a\nb", "a\rb", "a\x1bb", "a\u2028b", "a\u200bb"])
@pytest.mark.parametrize(
    "where",
    [
        ("run", MULTI, "--mode", "real", "--slurm", "--out", "{out}", "--sbatch", "partition=h100{bad}touch X"),
        ("run", MULTI, "--mode", "real", "--slurm", "--out", "{out}/run{bad}x"),
        ("run", MULTI, "--mode", "real", "--out", "{out}/run{bad}x"),
        ("run", MULTI, "--mode", "real", "--slurm", "--out", "{out}", "--records-dir", "{out}/rec{bad}x"),
        ("run", MULTI, "--mode", "dry-run", "--out", "{out}", "--gpu", "h100{bad}x"),
        ("run", "llama3_8b/table1/*{bad}x", "--mode", "real", "--slurm", "--out", "{out}"),
        ("results", "--out", "{out}/tables{bad}x"),
        ("results", "--records-dir", "{out}/rec{bad}x", "--out", "{out}"),
    ],
    ids=["sbatch", "out-slurm", "out-printed", "records-dir", "gpu", "recipe-id", "results-out", "results-records"],
)
def test_a_control_character_in_any_option_that_reaches_a_script_is_refused(tmp_path, where, bad):
    out = tmp_path / "o"
    args = [a.format(out=out, bad=bad) for a in where]
    with pytest.MonkeyPatch.context() as m:
        _no_spawn(m)
        res = invoke(*args)
    assert res.exit_code == 2, res.output
    assert "one line of visible text" in res.output and f"U+{ord(bad[1]):04X}" in res.output
    assert _files(tmp_path) == []  # nothing written: no run folder, no job, no script


# --------------------------------------------------------------------------- quoted, read back
def _stub(folder: Path, name: str, body: str) -> Path:
    path = folder / name
    path.write_text("#!/bin/bash\n" + body + "\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def _node_env() -> dict[str, str]:
    """A fresh node's shell: none of the launch's variables set."""
    return {"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", "/"), "TMPDIR": "/local", "USER": "u"}


def _run_sbatch_job(tmp_path: Path, monkeypatch, *args: str) -> tuple[Path, Path, list[str], dict[str, str]]:
    """`run-recipe run --slurm` into a folder named WEIRD, with this Python environment at a WEIRD
    path too; then the script run by bash as SLURM would on its first node, with stubs for
    scontrol, srun (which records its arguments and environment), python and torchrun.
    Returns (run dir, records dir, srun's arguments, srun's environment)."""
    venv = tmp_path / f"venv {WEIRD}"
    (venv / "bin").mkdir(parents=True)
    python = _stub(venv / "bin", "python", 'echo "torch stub"')
    _stub(venv / "bin", "torchrun", "exit 9")  # srun's stub never runs it
    stubs = tmp_path / "stubs"
    stubs.mkdir()
    _stub(stubs, "scontrol", "echo node1")
    _stub(
        stubs,
        "srun",
        f'printf "%s\\0" "$@" > {shlex.quote(str(tmp_path / "srun.args"))}\n'
        f"env -0 > {shlex.quote(str(tmp_path / 'srun.env'))}",
    )
    run_dir, records = tmp_path / f"run {WEIRD}", tmp_path / f"records {WEIRD}"
    with monkeypatch.context() as m:
        _no_spawn(m)
        m.setattr(sys, "executable", str(python))
        m.setattr(sys, "prefix", str(venv))
        res = invoke(
            "run", MULTI, "--mode", "real", "--slurm", "--out", str(run_dir), "--records-dir", str(records), *args
        )
    assert res.exit_code == 0, res.output
    script = run_dir / "sbatch.sh"
    subprocess.run(["bash", "-n", str(script)], check=True)
    (run_dir / "result.json").write_text("{}")  # what the ranks would have written
    env = {**_node_env(), "PATH": f"{stubs}:{os.environ['PATH']}", "SLURM_JOB_ID": "42"}
    env.update(SLURM_JOB_NODELIST="node1", SLURM_CPUS_ON_NODE="16")
    proc = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, (proc.stdout, proc.stderr, (run_dir / "slurm-42.out").read_text())
    args = (tmp_path / "srun.args").read_text().split("\0")[:-1]
    srun_env = dict(e.split("=", 1) for e in (tmp_path / "srun.env").read_text().split("\0") if "=" in e)
    return run_dir, records, args, srun_env


def test_paths_with_spaces_quotes_and_dollars_round_trip_through_the_sbatch_script(tmp_path, monkeypatch):
    run_dir, records, args, _ = _run_sbatch_job(tmp_path, monkeypatch)
    assert Path(args[args.index("--config") + 1]) == run_dir / "job.json"
    assert str(tmp_path / f"venv {WEIRD}" / "bin" / "torchrun") in args
    # the job's output: a quoted redirection into the run folder (no #SBATCH --output=, which
    # sbatch parses by its own rules and where it expands %j)
    script = (run_dir / "sbatch.sh").read_text()
    assert "#SBATCH --output" not in script
    log = (run_dir / "slurm-42.out").read_text()
    assert f"run-recipe: Python environment {tmp_path / f'venv {WEIRD}'}: torch stub" in log
    copied = records / "real" / "llama3_8b__table1__128gpu_fsdp.json"
    assert copied.read_text() == "{}"  # the record's cp line read both paths back


def test_the_printed_command_quotes_its_paths(tmp_path):
    run_dir = tmp_path / f"run {WEIRD}"
    with pytest.MonkeyPatch.context() as m:
        _no_spawn(m)
        res = invoke("run", MULTI, "--mode", "real", "--out", str(run_dir))
    assert res.exit_code == 0, res.output
    printed = next(line.strip() for line in res.output.splitlines() if " torchrun --nnodes" in line)
    words = shlex.split(printed)
    assert Path(words[words.index("--config") + 1]) == run_dir / "job.json"


# ------------------------------------------------------------------------- one environment
def _launch_sets(env: dict[str, str], base: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if base.get(k) != v and k not in SHELL_OWN}


def test_every_multinode_launch_sets_the_environment_of_a_local_one(tmp_path, monkeypatch):
    """A local real launch (recipes/launcher.py base_env + RealMode's own), the printed per-node
    command and the sbatch script set the same variables to the same values on a fresh node, the
    restarts' TORCH_DISABLE_SHARE_RDZV_TCP_STORE where restarts are asked; the sbatch script adds
    only what is its own by design (OMP threads from the node's cores, the run folder's lock)."""
    node = _node_env()
    for key in ("PYTHONPATH", "TORCHINDUCTOR_CACHE_DIR", *cluster_env.launch_env(max_restarts=1)):
        monkeypatch.delenv(key, raising=False)
    for key in cluster_env.REAL_ENV:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("TMPDIR", node["TMPDIR"])
    monkeypatch.setenv("USER", node["USER"])
    local = _launch_sets(modes.RealMode().env(8, max_restarts=2), dict(os.environ))
    assert local["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1" and local["PYTHONUNBUFFERED"] == "1"
    assert {**cluster_env.launch_env(2), **cluster_env.real_env_defaults()}.items() <= local.items()

    def printed_sets(restarts: str) -> dict[str, str]:
        with pytest.MonkeyPatch.context() as m:
            _no_spawn(m)
            res = invoke("run", MULTI, "--mode", "real", "--out", str(tmp_path / restarts), "--max-restarts", restarts)
        printed = next(line.strip() for line in res.output.splitlines() if " torchrun --nnodes" in line)
        prefix = printed.split(" torchrun ", 1)[0]
        out = subprocess.run(["bash", "-c", f"{prefix} env -0"], env=node, capture_output=True, text=True, check=True)
        return _launch_sets(dict(e.split("=", 1) for e in out.stdout.split("\0") if "=" in e), node)

    assert printed_sets("2") == local
    without = _launch_sets(modes.RealMode().env(8), dict(os.environ))
    assert printed_sets("0") == without == {k: v for k, v in local.items() if k not in cluster_env.RESTART_ENV}

    (tmp_path / "sbatch").mkdir()
    _, _, _, srun_env = _run_sbatch_job(tmp_path / "sbatch", monkeypatch, "--max-restarts", "2")
    sbatch = _launch_sets(srun_env, {**node, "PATH": srun_env["PATH"]})
    own = {"OMP_NUM_THREADS": "2", "TITAN_RUN_LOCK": "1"}  # 16 cores / 8 ranks; rank 0 takes the lock
    assert {k: sbatch.pop(k) for k in own} == own
    assert {k: v for k, v in sbatch.items() if not k.startswith("SLURM_")} == local
