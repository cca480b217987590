"""Options and `--set` keys refused before anything is spawned, in one line naming what to use
instead (exit 2): keys the command line owns, plan's bounds, forms of an option that would be
silently ignored, path components that escape their folder."""

from __future__ import annotations

import errno
import gzip
import json
import shlex

import pytest
from click.testing import CliRunner

from core import run_folder
from core.overrides import parse_override
from recipes.plan.layouts import plan
from tests import fault_utils
from tests.fault_utils import ROW, digest, invoke

pytestmark = pytest.mark.faults
no_spawn = fault_utils.no_spawn  # the fixture, registered in this module by name


# --------------------------------------------------------------------- keys the CLI owns
@pytest.mark.parametrize(
    ("text", "use"), [("job.mode=dry-run", "--mode"), ("job.recipe=x", "recipe id"), ("job.output_dir=/tmp/x", "--out")]
)
def test_set_of_a_key_the_cli_owns_is_refused(tmp_path, no_spawn, text, use):
    res = invoke("run", ROW, "--mode", "proxy", "--set", text, "--out", str(tmp_path / "out"))
    assert res.exit_code == 2, res.output
    assert text.split("=")[0] in res.output and use in res.output, res.output
    assert len(res.output.strip().splitlines()) == 1, res.output
    assert not (tmp_path / "out").exists()
    assert text.split("=")[0] not in invoke("keys", "job.").output  # not listed as a --set key


# ------------------------------------------------------------------------ whitespace in --set
@pytest.mark.parametrize("text", [" training.steps=7", "training.steps =7", " training . steps = 7 "])
def test_set_key_with_whitespace_around_it_is_read_as_toml_reads_it(text):
    assert parse_override(text) == ("training", "steps", 7)
    res = invoke("show", ROW, "--json", "--set", text, "--set", "model.flavor = tiny")
    assert res.exit_code == 0, res.output
    assert json.loads(res.output)["proxy"]["config"]["training"]["steps"] == 7


# --------------------------------------------------------------------- a corrupt titan.json
@pytest.mark.parametrize("text", ["garbage{", "[1, 2]", "null", "", '{"step": 4, "model_shape": 5}'])
def test_a_corrupt_checkpoint_info_is_one_line_naming_it(tmp_path, no_spawn, text):
    step = tmp_path / "run" / "checkpoint" / "step-4"
    step.mkdir(parents=True)
    (step / ".metadata").write_bytes(b"not read before spawn")
    (step / "titan.json").write_text(text)
    before = digest(tmp_path / "run")
    res = invoke("run", ROW, "--set", "checkpoint.enabled=true", "--out", str(tmp_path / "run"))
    assert res.exit_code == 2, res.output
    assert str(step / "titan.json") in res.output and "corrupted checkpoint info" in res.output
    assert len(res.output.strip().splitlines()) == 1, res.output
    assert digest(tmp_path / "run") == before and not (tmp_path / "run" / run_folder.LOCK).exists()


# -------------------------------------------------------------- preflight's one-device options
@pytest.mark.parametrize(
    "args", [["--quick"], ["--device", "cpu"], ["--rounds", "1"], ["--layers", "2", "--steps", "2"]]
)
def test_preflight_one_device_options_without_gpus_1_are_refused(tmp_path, no_spawn, args):
    res = invoke("preflight", "--out", str(tmp_path / "pf"), *args)
    assert res.exit_code == 2, res.output
    assert args[0] in res.output and "only with --gpus 1" in res.output
    assert len(res.output.strip().splitlines()) == 1, res.output
    assert not (tmp_path / "pf").exists()


# ------------------------------------------------------------------------------------ plan
@pytest.mark.parametrize(
    ("args", "option", "says"),
    [
        (["--gpu-mem", "nan"], "--gpu-mem", "above 0 and finite"),
        (["--gpu-mem", "inf"], "--gpu-mem", "above 0 and finite"),
        (["--gpus-per-node", "0"], "--gpus-per-node", "at least 1 GPU per node"),
        (["--gpus", "1024", "--global-batch", "3"], "--global-batch", "data-parallel ranks of no layout"),
        (["--top", "0"], "--top", "at least 1 candidate"),
        (["--days", "30"], "--days", "give --gpus, or --tokens and --days"),
        (["--tokens", "2T", "--json"], "--tokens", "only adds the days to the text answer"),
    ],
)
def test_plan_refuses_what_it_would_ignore_or_cannot_split(args, option, says):
    given = ["--model", "8B", *([] if "--gpus" in args else ["--gpus", "8"]), *args]
    res = CliRunner().invoke(plan, given)
    assert res.exit_code == 2, res.output
    assert option in res.output and says in res.output, res.output


@pytest.mark.parametrize("args", [["--gpus", "8"], ["--tokens", "1T", "--days", "1", "--gpu-mem", "1"]])
def test_plan_json_exits_as_the_text_answer(args):
    text = CliRunner().invoke(plan, ["--model", "8B", *args])
    as_json = CliRunner().invoke(plan, ["--model", "8B", *args, "--json"])
    assert text.exit_code == as_json.exit_code, (text.output, as_json.output)


# -------------------------------------------------------------- folders under the run folder
@pytest.mark.parametrize(
    "text",
    [
        "checkpoint.folder='../x'",
        "checkpoint.folder='a/../../x'",
        "checkpoint.folder='..'",
        "profiling.folder='../p'",
        "comm.fr_dump_folder='../../t'",
    ],
)
def test_a_folder_key_that_escapes_the_run_folder_is_refused(tmp_path, no_spawn, text):
    res = invoke("run", ROW, "--set", text, "--set", "profiling.enabled=true", "--out", str(tmp_path / "a" / "run"))
    assert res.exit_code == 2, res.output
    assert text.split("=")[0] in res.output and "sub-folder of job.output_dir" in res.output, res.output
    assert len(res.output.strip().splitlines()) == 1, res.output
    assert not (tmp_path / "a").exists()


# ------------------------------------------------------------------- the launch command shown
def test_the_launch_line_and_command_txt_are_shell_quoted(tmp_path, monkeypatch):
    from recipes import modes

    launched = []
    monkeypatch.setattr(modes, "stream", lambda cmd, *a, **k: launched.append(cmd) or 1)
    out = tmp_path / "it's a run"
    res = invoke("run", ROW, "--out", str(out), "--verbose")  # --verbose echoes the launch command
    assert res.exit_code == 1 and launched, res.output  # the stand-in launch failed: no record
    (cmd,) = launched
    assert shlex.split((out / "command.txt").read_text()) == cmd
    line = next(x for x in res.output.splitlines() if x.startswith("$ "))
    assert shlex.split(line[2:]) == cmd


# ----------------------------------------------------------------------- a huge sequence length
@pytest.mark.parametrize("mode", ["proxy", "dry-run"])
def test_a_huge_seq_len_is_refused_before_spawn(tmp_path, no_spawn, mode):
    res = invoke("run", ROW, "--mode", mode, "--set", "training.seq_len=4000000000", "--out", str(tmp_path / "run"))
    assert res.exit_code == 2, res.output
    assert "training.seq_len" in res.output and "4,000,000,000" in res.output and "1,048,576" in res.output
    assert len(res.output.strip().splitlines()) == 1, res.output
    assert not (tmp_path / "run").exists()


def test_what_only_a_rank_would_find_is_refused_before_spawn(tmp_path, no_spawn):
    """A vocabulary smaller than the tokenizer's and a shard holding an empty gzip stream were
    found by the ranks after spawn (tracebacks of every rank): now by the launcher, in one line."""
    res = invoke("run", ROW, "--out", str(tmp_path / "a"), "--set", "model.vocab_size=5")
    assert res.exit_code == 2 and "model.vocab_size: 5 is below the" in res.output, res.output
    en = tmp_path / "corpus" / "en"
    en.mkdir(parents=True)
    gzip.open(en / "c4-train.00000-of-00001.json.gz", "wb").close()
    res = invoke("run", ROW, "--out", str(tmp_path / "b"), "--set", f"data.path='{tmp_path / 'corpus'}'")
    assert res.exit_code == 2 and "holds no document (an empty gzip stream)" in res.output, res.output


def test_a_failed_save_is_called_a_full_disk_only_when_it_is_one(tmp_path):
    """The need was the global weights x world x 3 (always above the free space at 405B), so any
    failed first save read 'no space left on device', hiding the real cause."""
    from core.checkpoint.files import save_error

    folder, tmp = tmp_path / "checkpoint", tmp_path / "checkpoint" / "step-1.tmp"
    folder.mkdir()
    huge = 1 << 60  # bytes: more than any disk has free
    denied = save_error(folder, tmp, 1, "save", PermissionError(errno.EACCES, "Permission denied"), huge)
    assert "Permission denied" in str(denied) and "no space left" not in str(denied)
    full = save_error(folder, tmp, 1, "save", OSError(errno.ENOSPC, "No space left on device"), huge)
    assert "no space left on device: a checkpoint needs about" in str(full)
