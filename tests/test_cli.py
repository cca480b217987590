"""`run-recipe`: list, show, run (validation, refusals, multi-node launch), results; one e2e run."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time
import types
from pathlib import Path

import pandas as pd
import pytest
import torch
from click.testing import CliRunner

from core.config import JOB_MARKER
from recipes import launcher, modes, paths, registry
from recipes.cli import main
from tests.dist_utils import TINY_JOB
from tests.records import conforming

pytestmark = pytest.mark.core

ROOT = Path(__file__).resolve().parents[1]
ROW = "llama3_8b/table1/8gpu_fsdp"


def invoke(*args):
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


@pytest.fixture
def no_spawn(monkeypatch):
    def boom(*a, **k):
        raise AssertionError(f"spawned a process: {a}")

    monkeypatch.setattr(subprocess, "Popen", boom)
    monkeypatch.setattr(subprocess, "run", boom)


def test_list_ids_and_table():
    res = invoke("list", "--ids")
    assert res.exit_code == 0
    assert res.output.split() == [r.id for r in registry.all_recipes()]
    res = invoke("list", "--table", "table3")
    assert res.exit_code == 0
    lines = res.output.splitlines()
    assert "proxy world" in lines[0]
    assert sum("llama3_405b/table3/" in line for line in lines) == 2
    assert "64 nodes" in res.output


def test_show():
    res = invoke("show", "llama3_405b/table3/512gpu_3d_interleaved_1f1b")
    assert res.exit_code == 0, res.output
    for text in (
        "Interleaved1F1B",
        "405B",
        "tiny4",
        "paper_tps_per_gpu",
        "130",
        "80.3",
        "real:",
        "proxy:",
        "dry-run:",
        "sm89",
        "64 node(s)",
    ):
        assert text in res.output
    res = invoke("show", ROW, "--json")
    data = json.loads(res.output)
    assert data["paper"]["config"]["parallelism"]["dp_shard"] == 8
    assert data["proxy"]["world"] == 2
    assert data["reference"]["paper_tps_per_gpu"] == 6258
    assert invoke("show", "nope/none").exit_code == 2


@pytest.mark.parametrize(
    "override, key",
    [
        ("parallelism.tp=3", "parallelism.tp"),
        ("parallelism.nope=1", "parallelism.nope"),
        ("training.steps=abc", "training.steps"),
        ("training.seq_len=true", "training.seq_len"),
    ],
)
def test_bad_override_fails_fast_and_spawns_nothing(tmp_path, no_spawn, override, key):
    import core.models.llama3  # noqa: F401  (time the CLI's checks, not torch's cold import)

    out = tmp_path / "run"
    t0 = time.perf_counter()
    res = invoke("run", ROW, "--mode", "proxy", "--set", override, "--out", str(out))
    assert time.perf_counter() - t0 < 10
    assert res.exit_code == 2
    assert key in res.output and res.output.count("\n") == 1
    assert not out.exists()


def test_unknown_id_and_no_id(no_spawn):
    res = invoke("run", "llama3_8b/table1/8gpu_fsd")
    assert res.exit_code == 2 and "did you mean" in res.output
    assert invoke("run").exit_code == 2


def test_real_mode_refuses_without_cuda(tmp_path, no_spawn):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    out = tmp_path / "run"
    res = invoke("run", ROW, "--mode", "real", "--out", str(out))
    assert res.exit_code == 3
    assert "CUDA" in res.output and "--mode proxy" in res.output and "--slurm" in res.output
    assert not out.exists()


def test_slurm_writes_an_sbatch_script(tmp_path, no_spawn):
    res = invoke(
        "run",
        "llama3_8b/table1/128gpu_fsdp",
        "--mode",
        "real",
        "--slurm",
        "--sbatch",
        "partition=h100",
        "--out",
        str(tmp_path),
    )
    assert res.exit_code == 0, res.output
    script = (tmp_path / "sbatch.sh").read_text()
    assert str(tmp_path / "sbatch.sh") in res.output
    for text in (
        "#SBATCH --nodes=16",
        "#SBATCH --gpus-per-node=8",
        "#SBATCH --partition=h100",
        "srun",
        "torchrun",
        "--nnodes=16",
        "--nproc_per_node=8",
        "--rdzv_backend=c10d",
        '--rdzv_endpoint="$head_node:29500"',
        f"--config {tmp_path / 'job.json'}",
    ):
        assert text in script
    job = json.loads((tmp_path / "job.json").read_text())
    assert job["parallelism"]["dp_shard"] == 128 and job["job"]["mode"] == "real"
    assert job["job"]["output_dir"] == str(tmp_path.resolve())

    res = invoke(
        "run",
        "llama3_405b/table3/512gpu_3d_1f1b",
        "--mode",
        "real",
        "--slurm",
        "--out",
        str(tmp_path / "t3"),
        "--records-dir",
        str(tmp_path / "rec"),
    )
    script = (tmp_path / "t3" / "sbatch.sh").read_text()
    assert "#SBATCH --nodes=64" in script and "--nnodes=64" in script
    assert str(tmp_path / "rec" / "real" / "llama3_405b__table3__512gpu_3d_1f1b.json") in script


def test_multinode_real_prints_the_torchrun_command(tmp_path, no_spawn):
    res = invoke("run", "llama3_70b/table2/256gpu_fsdp_tp_compile_float8", "--mode", "real", "--out", str(tmp_path))
    assert res.exit_code == 0, res.output
    assert (
        "torchrun --nnodes=32 --nproc_per_node=8" in res.output
        and "--rdzv_backend=c10d --rdzv_endpoint=$HOST:29500" in res.output
    )


def test_dry_run(tmp_path, monkeypatch, no_spawn):
    monkeypatch.setattr(launcher, "dry_run_available", lambda: False)
    res = invoke("run", ROW, "--mode", "dry-run", "--out", str(tmp_path / "a"))
    assert res.exit_code == 3 and "dry-run is not available in this build" in res.output
    assert not (tmp_path / "a").exists()

    # the plumbing, with a stand-in estimator (this test's input, not a figure)
    seen = {}
    fake = types.ModuleType("core.dryrun.record")
    fake.dry_run = lambda cfg: seen.setdefault("cfg", cfg) and {"peak_memory_gib": 1.0}
    monkeypatch.setitem(sys.modules, "core.dryrun.record", fake)
    monkeypatch.setattr(launcher, "dry_run_available", lambda: True)
    # the record's commit comes from git, the one process a dry-run asks of (no_spawn refuses it)
    monkeypatch.setattr("core.result.git_state", lambda: {"git": "abc1234", "git_dirty": False})
    res = invoke("run", ROW, "--mode", "dry-run", "--out", str(tmp_path / "b"), "--records-dir", str(tmp_path / "rec"))
    assert res.exit_code == 0, res.output
    assert seen["cfg"].parallelism.world_size == 8 and seen["cfg"].model.flavor == "8B"
    rec = json.loads((tmp_path / "rec" / "dry-run" / "llama3_8b__table1__8gpu_fsdp.json").read_text())
    assert rec["recipe"] == ROW and rec["mode"] == "dry-run"
    assert rec["versions"]["git"] == "abc1234" and rec["provenance"]["deviations"] == []
    assert rec["provenance"]["assets"] is None  # a dry-run reads no data
    assert (tmp_path / "b" / "result.json").is_file()


def test_launch_command_and_env(monkeypatch):
    cmd = modes.RealMode().command(4, [Path("/x/job.json")])
    assert cmd[:3] == [sys.executable, "-m", "recipes.agent"]  # torchrun, tethered to the launcher
    assert "--standalone" in cmd and "--nproc_per_node=4" in cmd
    assert cmd[-4:] == ["-m", "core.train", "--config", "/x/job.json"]
    proxy = modes.PROXY.command(4, [Path("/x/job.json")])  # the same options, ranks forked
    assert proxy == [sys.executable, "-u", "-m", "recipes.forked_run", *cmd[3:]]
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    env = modes.PROXY.env(4)
    assert env["OMP_NUM_THREADS"] == "1" and env["CUDA_VISIBLE_DEVICES"] == ""
    # one rank compiles each graph while the others wait: its C++ kernels build on every core
    assert env["TORCHINDUCTOR_COMPILE_THREADS"] == str(launcher.usable_cpus()) == str(len(os.sched_getaffinity(0)))
    assert "OMP_NUM_THREADS" not in modes.PROXY.env(1)
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    assert modes.PROXY.env(2)["TORCHINDUCTOR_CACHE_DIR"] == launcher.inductor_cache_dir()  # the checkout's
    # a real run compiles into a node-local cache, as the sbatch script's (the checkout is often NFS)
    monkeypatch.setenv("TMPDIR", "/scratch/local")
    assert modes.RealMode().env(8)["TORCHINDUCTOR_CACHE_DIR"].startswith("/scratch/local/titan_inductor_")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/tmp/mine")
    assert modes.PROXY.env(2)["TORCHINDUCTOR_CACHE_DIR"] == "/tmp/mine"  # the caller's wins
    assert modes.RealMode().env(2)["TORCHINDUCTOR_CACHE_DIR"] == "/tmp/mine"


def test_one_torchrun_command_builder():
    local = launcher.torchrun_command(2, ["script.py", "plan.json"], max_restarts=1)
    assert local == [
        sys.executable,
        "-m",
        "recipes.agent",
        "--standalone",
        "--nnodes=1",
        "--nproc_per_node=2",
        "--max-restarts=1",
        "script.py",
        "plan.json",
    ]
    multi = launcher.torchrun_command(
        8, launcher.trainer_target("j.json"), nnodes=4, rdzv_id="x", rdzv_endpoint="h:1", exe="torchrun"
    )
    assert multi == [
        "torchrun",
        "--nnodes=4",
        "--nproc_per_node=8",
        "--rdzv_id=x",
        "--rdzv_backend=c10d",
        "--rdzv_endpoint=h:1",
        "-m",
        "core.train",
        "--config",
        "j.json",
    ]
    assert modes.PROXY.env(1, OMP_NUM_THREADS="1")["OMP_NUM_THREADS"] == "1"
    assert paths.results_root() == paths.project_root() / "results"


def _record(rid, tps, losses, mode="proxy"):
    return {
        "recipe": rid,
        "mode": mode,
        "hardware": {"device": "test-cpu"},
        "world_size": 2,
        "tokens_per_sec_per_device": tps,
        "mfu": 0.1,
        "peak_memory_gib": 0.5,
        "losses": losses,
        "steps": len(losses),
        "toggles_applied": ["fsdp"],
    }


def test_results_from_records_only(tmp_path):
    rec = tmp_path / "records"
    (rec / "proxy").mkdir(parents=True)
    base, comp = "llama3_8b/table1/8gpu_fsdp", "llama3_8b/table1/8gpu_fsdp_compile"
    for rid, tps in ((base, 1000.0), (comp, 1250.0)):
        (rec / "proxy" / (rid.replace("/", "__") + ".json")).write_text(
            json.dumps(conforming(_record(rid, tps, [8.0, 7.0])))
        )
    lc = "llama3_8b/loss_convergence/"
    for name, last in (("1d_fsdp8", 7.0), ("2d_fsdp8_cp8", 7.0 + 2e-6)):
        record = conforming(_record(lc + name, 900.0, [8.0, last]))
        (rec / "proxy" / ((lc + name).replace("/", "__") + ".json")).write_text(json.dumps(record))
    out = tmp_path / "results"
    res = invoke("results", "--records-dir", str(rec), "--out", str(out))
    assert res.exit_code == 0, res.output
    for table in ("table1", "table2", "table3", "table4", "table5"):
        assert (out / f"{table}.md").is_file() and (out / f"{table}.csv").is_file()
    # loss_convergence.csv holds the curves (step x row); its table is loss_convergence_table.csv
    assert (out / "loss_convergence.md").is_file() and (out / "loss_convergence_table.csv").is_file()
    assert list(pd.read_csv(out / "loss_convergence.csv").columns) == ["step", "1d_fsdp8", "2d_fsdp8_cp8"]
    t1 = pd.read_csv(out / "table1.csv").set_index("recipe")
    assert len(t1) == 6
    assert t1.loc[base, "ours TPS/device"] == 1000.0 and t1.loc[base, "ours mode"] == "proxy"
    assert t1.loc[comp, "ours gain %"] == pytest.approx(25.0)
    assert t1.loc[comp, "paper gain %"] == pytest.approx(6.65, abs=0.01)
    assert t1.loc[base, "paper TPS/GPU"] == 6258 and t1.loc[base, "bench-2412 mem GiB"] == 82.4
    missing = t1.loc["llama3_8b/table1/128gpu_fsdp"]
    assert missing[["ours mode", "ours TPS/device", "ours final loss", "dry-run est. mem GiB"]].isna().all()
    assert missing["paper TPS/GPU"] == 5645  # the paper column is always there
    t4 = pd.read_csv(out / "table4.csv")
    assert t4["ours TPS/device"].isna().all() and len(t4) == 4
    lcv = pd.read_csv(out / "loss_convergence_table.csv").set_index("recipe")
    assert lcv.loc[lc + "2d_fsdp8_cp8", "max |Δloss| vs baseline"] == pytest.approx(2e-6, rel=1e-3)
    md = (out / "table1.md").read_text()
    assert "~81.9" in md and "+25.00%" in md and "2 of 6 rows" in md
    readme = (out / "README.md").read_text()
    assert "table1.md" in readme and "loss_convergence.md" in readme and "How each number" in readme


@pytest.mark.slow
def test_e2e_proxy_run_of_a_table1_row(tmp_path):
    """The real thing: run-recipe -> torchrun (world 2) -> core.train -> result.json in --out, with
    the model's shape from --set (model.dim, ... override the row's flavor)."""
    out = tmp_path / "run"
    shape = {"dim": 128, "n_layers": 2, "n_heads": 8, "n_kv_heads": 8}  # vocabulary: the tokenizer's
    args = [
        sys.executable,
        "-m",
        "recipes.cli",
        "run",
        ROW,
        "--mode",
        "proxy",
        "--set",
        "training.steps=3",
        "--set",
        "metrics.progress=false",
        "--out",
        str(out),
        *[a for k, v in shape.items() for a in ("--set", f"model.{k}={v}")],
    ]
    if (
        not (ROOT / "assets" / "c4_offline").exists()
        or not (ROOT / "assets" / "tokenizer" / "proxy_bpe_4k" / "tokenizer.model").is_file()
    ):
        args += ["--set", "data.dataset=synthetic"]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run(args, check=False, capture_output=True, text=True, env=env, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rec = json.loads((out / "result.json").read_text())
    assert rec["recipe"] == ROW and rec["mode"] == "proxy"
    assert rec["world_size"] == 2 and rec["steps"] == 3 and len(rec["losses"]) == 3
    assert rec["config"]["parallelism"]["dp_shard"] == 2
    assert {k: rec["model"][k] for k in shape} == shape and rec["model"]["vocab_size"] == 4352
    assert rec["model"]["param_count"] == rec["model"]["params"] == 1_639_040  # 2 * 128 * 4352 + 2 blocks + norm
    assert rec["tokens_per_sec_per_device"] > 0
    timings = rec["timings_s"]  # where the row's time went, phase by phase
    assert {
        "process_start_and_imports",
        "init_distributed",
        "trainer_init",
        "first_step",
        "later_steps",
        "other",
    } <= set(timings) and timings["process_start_and_imports"] > 0.5  # torch alone takes longer
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in steps] == [1, 2, 3] and all(m["tokens_per_sec_per_device"] > 0 for m in steps)
    assert (out / "job.json").is_file() and (out / "train.log").is_file()
    record_line = [line for line in proc.stdout.splitlines() if line.startswith("record: ")]
    assert record_line and "->" not in record_line[0]  # with --out the record stays in --out


def test_show_explains_the_keys_it_lists():
    res = invoke("show", ROW)
    assert res.exit_code == 0, res.output
    assert "meaning" in res.output and "tokens per sequence" in res.output


@pytest.mark.slow
def test_rows_of_one_world_size_share_one_torchrun(tmp_path):
    """Two world-2 rows in one command: one torchrun runs both (core.train's multi-job launch),
    each row keeps its own run dir, log and record, and the second row's losses are those of the
    same job launched alone."""
    other = "llama3_8b/loss_convergence/1d_fsdp8"
    out = tmp_path / "runs"
    shape = [
        "--set",
        "model.dim=64",
        "--set",
        "model.n_layers=1",
        "--set",
        "model.n_heads=4",
        "--set",
        "model.n_kv_heads=4",
    ]
    args = [sys.executable, "-m", "recipes.cli", "run", other, ROW, "--verbose", "--set", "training.steps=3", *shape]
    args += ["--set", "data.dataset=synthetic", "--set", "model.vocab_size=512", "--out", str(out)]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run(args, check=False, capture_output=True, text=True, env=env, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert sum(line.startswith("$ ") for line in proc.stdout.splitlines()) == 1  # one launch
    dirs = {rid: out / registry.get(rid).fname for rid in (other, ROW)}
    commands = {(d / "command.txt").read_text() for d in dirs.values()}
    assert len(commands) == 1 and commands.pop().count("--config") == 2
    for rid, d in dirs.items():
        rec = json.loads((d / "result.json").read_text())
        assert rec["recipe"] == rid and len(rec["losses"]) == 3
        log = (d / "train.log").read_text()
        steps = [line.split()[1] for line in log.splitlines() if line.startswith("step ")]
        assert steps and steps[-1] == "3/3" and len(steps) == len(set(steps)), log[-2000:]  # its own step lines only
        assert JOB_MARKER not in log and JOB_MARKER not in proc.stdout
    second = json.loads((dirs[ROW] / "result.json").read_text())
    assert "process_start_and_imports" not in second["timings_s"]  # paid by the first row
    assert commands_of(proc.stdout)[0][:4] == [sys.executable, "-u", "-m", "recipes.forked_run"]
    # the same job alone, under torchrun itself (fresh interpreters): the same losses
    alone = tmp_path / "alone"
    cmd = launcher.torchrun_command(2, launcher.trainer_target(dirs[ROW] / "job.json", [f"--job.output_dir={alone}"]))
    env = modes.PROXY.env(2)
    ran = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert ran.returncode == 0, ran.stderr[-3000:]
    assert json.loads((alone / "result.json").read_text())["losses"] == second["losses"]


def commands_of(stdout: str) -> list[list[str]]:
    return [shlex.split(line[2:]) for line in stdout.splitlines() if line.startswith("$ ")]


@pytest.mark.slow
def test_forked_launch_reports_a_failing_rank(tmp_path):
    """A rank that exits non-zero fails the forked launch as it fails torchrun: the launcher's exit
    code is non-zero and the rank's own message is in the output."""
    target = launcher.trainer_target(None, [*TINY_JOB, "--parallelism.dp_shard=4", f"--job.output_dir={tmp_path}"])
    cmd = launcher.torchrun_command(2, target, forked=True)
    env = modes.PROXY.env(2)
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode != 0 and "not the world size 2" in proc.stderr, proc.stderr[-3000:]
    with pytest.raises(ValueError, match="one node"):
        launcher.torchrun_command(2, target, forked=True, nnodes=2, rdzv_endpoint="h:1")


def test_job_logs_split_a_multi_job_launch_at_its_markers(tmp_path):
    from recipes.output import JobLogs

    a, b = tmp_path / "a.log", tmp_path / "b.log"
    logs = JobLogs(a, {str(tmp_path / "ja"): a, str(tmp_path / "jb"): b})
    chunks = ["torchrun says hi\n@@titan-", f"job {tmp_path / 'ja'}\nbar 1/2\rbar 2/2", f"@@titan-job {tmp_path}/j"]
    chunks += ["b\nsecond job\rbar", "\n"]
    echoed = "".join(logs.write(c) for c in chunks) + logs.close()
    # the prelude goes to the first log; a redrawn line keeps its last frame there
    assert a.read_bytes() == b"torchrun says hi\nbar 2/2\n"
    assert b.read_bytes() == b"bar\n"
    assert echoed == "torchrun says hi\nbar 1/2\rbar 2/2\nsecond job\rbar\n"  # markers are not echoed


def test_rows_after_a_failed_row_get_a_launch_of_their_own(tmp_path, monkeypatch):
    """A shared launch that ends with a row's failure: the rows before it keep their records, that
    row is reported, the rows after it run again in a new launch."""
    rows = []
    for rid in (
        "llama3_8b/table1/8gpu_fsdp",
        "llama3_8b/table1/8gpu_fsdp_compile",
        "llama3_8b/loss_convergence/1d_fsdp8",
    ):
        r = registry.get(rid)
        cfg = registry.resolve_config(r, "proxy", [], check_files=False)
        run_dir = tmp_path / r.fname
        run_dir.mkdir()
        cfg.job.output_dir = str(run_dir)
        rows.append(modes.Row(r, cfg, run_dir, run_dir / "job.json"))
    (rows[2].run_dir / "result.json").write_text("{}")  # a previous run's record: not this run's
    time.sleep(0.05)
    launches = []

    def fake_stream(cmd, env, log, job_logs=None, verbose=False):
        configs = [cmd[i + 1] for i, a in enumerate(cmd) if a == "--config"]
        launches.append(configs)
        if len(launches) == 1:  # the first row trains, the second fails, the third never starts
            (rows[0].run_dir / "result.json").write_text("{}")
            return 1
        (rows[2].run_dir / "result.json").write_text("{}")
        return 0

    monkeypatch.setattr(modes, "stream", fake_stream)
    shares = {
        (m, n): modes.MODES[m](modes.RunOptions(max_restarts=n)).shares_launch()
        for m in ("proxy", "real")
        for n in (0, 2)
    }
    assert [len(g) for g in modes.groups(rows, shares["proxy", 0])] == [3]
    assert [len(g) for g in modes.groups(rows, shares["real", 0])] == [1, 1, 1]  # real rows: one launch each
    assert [len(g) for g in modes.groups(rows, shares["proxy", 2])] == [1, 1, 1]  # a restart resumes one job
    failed = modes.run_local_rows(rows, modes.ProxyMode(modes.RunOptions()))
    assert failed == [rows[1].recipe.id]
    assert launches == [[str(r.job) for r in rows], [str(rows[2].job)]]
    assert all((r.run_dir / "command.txt").is_file() for r in rows)
