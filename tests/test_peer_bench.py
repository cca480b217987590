"""`run-recipe peer-bench` without the network or torchtitan: the CPU patches on synthetic copies
of their target text, the two trainers' command lines, the tps parsing, the CSV append, the
tokenizer build, and the refusals that happen before anything is set up or run."""

from __future__ import annotations

import csv
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from core.config import load_config
from core.validate import validate
from recipes.cli import main
from recipes.peer_bench import command, environment, runs
from recipes.peer_bench.patches import PATCHES, Patch, PatchError, apply_all, apply_patch, patch_state
from tests.fault_utils import no_spawn  # noqa: F401 - a fixture: any subprocess fails the test

pytestmark = pytest.mark.core


def _python_around(snippets: tuple[str, ...]) -> str:
    """A compilable module holding each snippet at its own indentation (inside a function, under
    as many `if True:` as it needs), as the installed file holds it."""
    out = ["import os\n"]
    for s in snippets:
        depth = (len(s) - len(s.lstrip(" "))) // 4
        if depth:
            out.append("def _f():\n" + "".join("    " * d + "if True:\n" for d in range(1, depth)))
        out.append(s + ("" if s.endswith("\n") else "\n"))
        out.append("\n")
    return "".join(out)


def _target(patch: Patch) -> str:
    return _python_around(tuple(e.old for e in patch.edits))


def _fake_torchtitan(tmp_path: Path) -> Path:
    pkg = tmp_path / "torchtitan"
    for p in PATCHES:
        (pkg / p.path).parent.mkdir(parents=True, exist_ok=True)
        (pkg / p.path).write_text(_target(p))
    return pkg


# --------------------------------------------------------------------------------- patches
def test_five_patches_each_with_a_reason():
    assert len(PATCHES) == 5
    assert len({p.name for p in PATCHES}) == 5
    assert all(p.reason and p.edits for p in PATCHES)


@pytest.mark.parametrize("patch", PATCHES, ids=lambda p: p.name)
def test_patch_applies_to_its_target_text_once(patch):
    text = _target(patch)
    assert patch_state(patch, text) == "applicable"
    out = apply_patch(patch, text)
    assert all(e.new in out for e in patch.edits)
    assert f"peer-bench patch {patch.name}" in out
    assert patch_state(patch, out) == "applied"
    assert apply_patch(patch, out) == out  # a second run changes nothing
    compile(out, patch.path, "exec")


@pytest.mark.parametrize("patch", PATCHES, ids=lambda p: p.name)
def test_patch_refuses_when_its_target_text_is_missing(patch):
    for edit in patch.edits:
        text = _target(patch).replace(edit.old, "pass\n" if edit.old.endswith("\n") else "pass")
        with pytest.raises(PatchError, match=f"patch {patch.name} no longer applies.*does not contain") as e:
            apply_patch(patch, text)
        assert patch.path in str(e.value) and "0.3.0" in str(e.value)


def test_patch_refuses_a_target_text_found_twice():
    patch = PATCHES[0]
    text = _target(patch) * 2
    with pytest.raises(PatchError, match="2 times"):
        apply_patch(patch, text)


def test_apply_all_patches_a_package_and_is_idempotent(tmp_path):
    pkg = _fake_torchtitan(tmp_path)
    assert apply_all(pkg) == [(p.name, "applied now") for p in PATCHES]
    first = {p.path: (pkg / p.path).read_text() for p in PATCHES}
    assert apply_all(pkg) == [(p.name, "already applied") for p in PATCHES]
    assert first == {p.path: (pkg / p.path).read_text() for p in PATCHES}


def test_apply_all_writes_nothing_when_one_patch_does_not_apply(tmp_path):
    pkg = _fake_torchtitan(tmp_path)
    last = PATCHES[-1]
    (pkg / last.path).write_text("# another release\n")
    before = {p.path: (pkg / p.path).read_text() for p in PATCHES}
    with pytest.raises(PatchError, match=last.name):
        apply_all(pkg)
    assert before == {p.path: (pkg / p.path).read_text() for p in PATCHES}
    (pkg / last.path).unlink()
    with pytest.raises(PatchError, match="does not exist"):
        apply_all(pkg)


# ------------------------------------------------------------------------------ commands
def test_torchtitan_command_line(tmp_path):
    venv, work = tmp_path / "venv", tmp_path / "work"
    cmd = runs.torchtitan_command(venv, 2, 12, work, tmp_path / "logs")
    assert cmd[0] == str(venv / "bin" / "torchrun")
    assert "--standalone" in cmd and "--nproc_per_node=2" in cmd
    assert cmd[cmd.index("-m") + 1] == "torchtitan.train"
    joined = " ".join(cmd)
    for flag in (
        "--module llama3",
        "--config llama3_debugmodel",
        f"--hf-assets-path={work / 'tokenizer'}",
        f"--dataloader.dataset-path={work / 'c4_test'}",
        "--training.seq-len=512",
        "--training.local-batch-size=8",
        "--training.steps=12",
        "--training.mixed-precision-param=bfloat16",
        "--training.mixed-precision-reduce=float32",
        "--parallelism.data-parallel-shard-degree=2",
        "--parallelism.spmd-backend=partial_dtensor",
        "--compile.no-enable",
        "--checkpoint.no-enable",
        "--validator.no-enable",
        "--local-ranks-filter=0",
    ):
        assert flag in joined, flag
    assert cmd[-1] == "activation-checkpoint:none"  # tyro's subcommand comes after every flag
    # torchrun's own options come before its target
    assert cmd.index("--local-ranks-filter=0") < cmd.index("-m")


def test_torchtitan_env_threads_and_offline(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", "/somewhere")
    one, two = runs.torchtitan_env(1, tmp_path), runs.torchtitan_env(2, tmp_path)
    assert (one["OMP_NUM_THREADS"], two["OMP_NUM_THREADS"]) == ("2", "1")
    assert "PYTHONPATH" not in one
    assert one["HF_HUB_OFFLINE"] == one["HF_DATASETS_OFFLINE"] == "1"
    assert one["HF_HOME"].startswith(str(tmp_path))


def test_ours_has_the_torchtitan_debug_shape():
    overrides = runs.ours_overrides(12, ("training.bf16_gemm=native",))
    cfg = validate(load_config(None, overrides), 2, check_files=False)
    m, t = cfg.model, cfg.training
    assert (m.dim, m.n_layers, m.n_heads, m.n_kv_heads, m.vocab_size) == (256, 6, 16, 16, 2048)
    assert (t.seq_len, t.local_batch_size, t.steps) == (512, 8, 12)
    assert (t.mixed_precision_param, t.mixed_precision_reduce, t.bf16_gemm) == ("bfloat16", "float32", "native")
    assert cfg.data.dataset == "synthetic" and cfg.activation_checkpoint.mode == "none" and not cfg.compile.enabled
    assert runs.ours_name(("training.bf16_gemm=native",)) == "titan-recipes (training.bf16_gemm=native)"
    assert runs.ours_name() == "titan-recipes"


def test_torchtitan_tps_and_the_steady_mean():
    log = "\n".join(
        [
            "[default0]:[titan] ... - INFO - step:  1  loss:  8.1  memory:  1.12GiB(4.75%)  tps: 15  tflops: 0.00",
            "[default0]:[titan] ... - INFO - step:  2  loss:  8.1  tps: 1,046  tflops: 0.00",
            "[default0]:[titan] ... - INFO - step:  3  loss:  7.8  tps: 3,041  tflops: 0.00",
            "[default0]:[titan] ... - INFO - validate step:  3  loss:  7.9  tps: 99,999",
            "[default0]:[titan] ... - INFO - step:  4  loss:  7.6  tps: 3,059  tflops: 0.00",
        ]
    )
    tps = runs.torchtitan_tps(log)
    assert tps == {1: 15.0, 2: 1046.0, 3: 3041.0, 4: 3059.0}
    assert runs.steady_mean(tps, 4, "log") == pytest.approx(3050.0)
    with pytest.raises(ValueError, match=r"steps \[5\]"):
        runs.steady_mean(tps, 5, "log")


# ----------------------------------------------------------------------------------- CSV
@pytest.mark.parametrize("newline", ["\n", "\r\n"], ids=["LF", "CRLF"])
def test_csv_append_keeps_the_rows_and_columns(tmp_path, newline):
    path = tmp_path / "peer.csv"
    lines = [
        "date,cpu,trainer,nproc,round,steps,tokens_per_s_per_rank",
        "2026-11-23T22:55:11Z,AMD EPYC (no-amx),titan-recipes,1,1,12,3369",
        "2026-11-23T22:55:11Z,AMD EPYC (no-amx),torchtitan-0.3.0,1,1,12,3494",
    ]
    old = "".join(line + newline for line in lines).encode()
    path.write_bytes(old)
    row = {"date": "d", "cpu": "AMD EPYC, AVX2, no AVX-512, no AMX", "trainer": "t", "nproc": 2}
    runs.append_rows(path, [{**row, "round": 1, "steps": 6, "tokens_per_s_per_rank": 700}])
    data = path.read_bytes()
    assert data.startswith(old)  # the existing bytes, line ends included
    assert data[len(old) :] == f'd,"AMD EPYC, AVX2, no AVX-512, no AMX",t,2,1,6,700{newline}'.encode()
    with open(path, newline="") as f:
        assert [r["tokens_per_s_per_rank"] for r in csv.DictReader(f)] == ["3369", "3494", "700"]


def test_csv_append_refuses_a_file_with_other_columns(tmp_path):
    path = tmp_path / "peer.csv"
    path.write_text("date,trainer,value\nx,y,1\n")
    with pytest.raises(ValueError, match="expected"):
        runs.append_rows(path, [dict.fromkeys(runs.COLUMNS, "1")])
    assert path.read_text() == "date,trainer,value\nx,y,1\n"
    fresh = tmp_path / "new.csv"
    runs.append_rows(fresh, [dict.fromkeys(runs.COLUMNS, "1")])
    assert fresh.read_text().splitlines() == [",".join(runs.COLUMNS), "1,1,1,1,1,1,1"]


# ------------------------------------------------------------------------------ the command
@pytest.fixture
def nothing_runs(monkeypatch):
    """Setting up or running fails the test (with no_spawn: so does any subprocess)."""
    monkeypatch.setattr(environment, "setup", lambda *a: pytest.fail("set up"))
    monkeypatch.setattr(command, "compare", lambda *a: pytest.fail("ran"))


@pytest.mark.parametrize(
    "args, says",
    [
        (["--rounds", "0"], "--rounds"),
        (["--steps", "2"], "--steps"),
        (["--nproc", "0"], "at least 1"),
        (["--nproc", "1,x"], "not a process count"),
        (["--ours-set", "training.no_such_key=1"], "no_such_key"),
        (["--ours-set", "model.n_heads=7"], "does not divide"),
        (["--nproc", "64"], "proxy_world_limit"),
    ],
)
@pytest.mark.usefixtures("no_spawn", "nothing_runs")
def test_bad_options_are_refused_before_anything_starts(args, says):
    res = CliRunner().invoke(main, ["peer-bench", *args])
    assert res.exit_code == 2, res.output
    assert says in res.output


def test_setup_only_sets_up_and_stops(monkeypatch, tmp_path):
    seen = []
    monkeypatch.setattr(environment, "setup", lambda venv, say: seen.append(venv))
    monkeypatch.setattr(command, "compare", lambda *a: pytest.fail("ran with --setup-only"))
    res = CliRunner().invoke(main, ["peer-bench", "--setup-only", "--venv", str(tmp_path / "v")])
    assert res.exit_code == 0, res.output
    assert seen == [(tmp_path / "v").resolve()] and "setup done" in res.output


def test_unreachable_index_is_one_line_and_exit_3(monkeypatch):
    def offline(venv, say):
        environment.check_index("http://127.0.0.1:9/simple", timeout=5)

    monkeypatch.setattr(environment, "setup", offline)
    res = CliRunner().invoke(main, ["peer-bench", "--setup-only"])
    assert res.exit_code == 3, res.output
    (line,) = res.output.strip().splitlines()
    assert line.startswith("error: cannot reach the package index (http://127.0.0.1:9/simple/torchtitan/")


def test_packages_ready_needs_the_three_pins():
    ok = {"torch": "2.13.0+cpu", "torchtitan": "0.3.0", "triton": environment.TRITON_VERSION}
    assert environment.packages_ready(ok, "2.13.0")
    assert not environment.packages_ready({**ok, "torch": "2.12.0"}, "2.13.0")
    assert not environment.packages_ready({**ok, "torchtitan": None}, "2.13.0")


def test_tokenizer_build_writes_what_torchtitan_loads(tmp_path):
    pytest.importorskip("tokenizers", reason="tokenizers is a test extra (pip install -e .[test])")
    import json

    from tokenizers import Tokenizer

    corpus = tmp_path / "data.json"
    lines = [json.dumps({"text": f"Line {i}: to be, or not to be, that is the question."}) for i in range(50)]
    corpus.write_text("\n".join(lines) + "\n")
    out = tmp_path / "tok"
    res = subprocess.run(
        [sys.executable, str(environment.TOKENIZER_SCRIPT), str(corpus), str(out)], capture_output=True, text=True
    )
    assert res.returncode == 0, res.stderr
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    config = json.loads((out / "tokenizer_config.json").read_text())
    assert tok.get_vocab_size() <= 2048
    assert tok.token_to_id(config["bos_token"]) == 0 and tok.token_to_id(config["eos_token"]) == 1
    assert tok.decode(tok.encode("not to be").ids) == "not to be"


@pytest.mark.parametrize("nproc,threads", [(1, "2"), (2, "1")])
def test_run_ours_launches_the_trainer_with_its_threads_and_reads_its_metrics(nproc, threads, monkeypatch, tmp_path):
    """run_ours through the project's launcher (a stand-in bound to modes.launch_trainer's real
    signature, so a changed launcher fails here): the shared shape, the thread count per rank, and
    the mean of the steady steps of the metrics the trainer wrote."""
    import inspect

    from recipes import modes

    real = inspect.signature(modes.launch_trainer)
    seen = {}

    def launch(*args, **kwargs):
        bound = real.bind(*args, **kwargs)
        seen.update(bound.arguments)
        lines = [f'{{"step": {s}, "tokens_per_sec_per_device": {100.0 * s}}}\n' for s in range(1, 6)]
        Path(bound.arguments["out_dir"], "metrics.jsonl").write_text("".join(lines))
        return {}

    monkeypatch.setattr(environment, "work_dir", lambda: tmp_path / "work")
    monkeypatch.setattr(modes, "launch_trainer", launch)
    tps = runs.run_ours(nproc, 5, ("training.seed=3",))
    assert tps == pytest.approx((300 + 400 + 500) / 3)  # steps FIRST_STEADY (3) .. 5
    assert seen["world"] == nproc and seen["overrides"] == runs.ours_overrides(5, ("training.seed=3",))
    assert seen["env"] == {"OMP_NUM_THREADS": threads}
